"""router.yaml (and tenants.yaml) errors name ``file:line: key: reason``.

One bad file per failure mode lives in tests/data/bad_configs/. Its first
line says what the error must be::

    # expect: LINE: KEY: REASON-REGEX

Files named ``tenants_*.yaml`` are tenant policy files, the others router
configs. Every file is checked twice: by ``load_yaml`` and by
``fairstream check-config`` (which must exit 1 and print the same line).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.config import RouterConfig
from router.configfile import ConfigError, load_yaml
from router.tenants import TenantsFile
from tests.helpers import ROOT

BAD = Path(__file__).resolve().parents[1] / "data" / "bad_configs"
FILES = sorted(BAD.glob("*.yaml"))
_EXPECT = re.compile(r"^# expect: (\d+): (.+?): (.+)$")

LOAD_BUGS: dict = {}
CLI_BUGS: dict = {}


def expectation(path: Path) -> tuple[int, str, str]:
    m = _EXPECT.match(path.read_bytes().decode("utf-8", "replace").splitlines()[0])
    assert m, f"{path.name}: first line must be '# expect: LINE: KEY: REASON-REGEX'"
    return int(m.group(1)), m.group(2), m.group(3)


def kind_of(path: Path) -> type:
    return TenantsFile if path.name.startswith("tenants_") else RouterConfig


def _params(bugs: dict[str, pytest.MarkDecorator]):
    return [pytest.param(p, id=p.stem, marks=[bugs[p.name]] if p.name in bugs else []) for p in FILES]


def check_error_line(path: Path, line: str) -> None:
    """``line`` is the located error the file's header expects."""
    want_line, want_key, want_reason = expectation(path)
    m = re.fullmatch(rf"{re.escape(str(path))}:(\d+): (.+?): (.+)", line)
    assert m, f"not `{path}:LINE: KEY: reason`: {line!r}"
    assert (int(m.group(1)), m.group(2)) == (want_line, want_key), line
    assert re.search(want_reason, m.group(3)), line


def test_there_is_a_file_per_failure_mode() -> None:
    names = {p.stem for p in FILES}
    for mode in ("unknown_top_key", "wrong_type_port", "missing_replicas", "tenants_duplicate_digest",
                 "tenants_bad_digest", "syntax_error"):
        assert mode in names


@pytest.mark.parametrize("path", _params(LOAD_BUGS))
def test_load_names_file_line_key_and_reason(path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml(path, kind_of(path))
    errors = info.value.errors
    assert len(errors) == 1, errors  # one failure mode per file
    check_error_line(path, errors[0])
    assert str(info.value) == errors[0]


@pytest.fixture(scope="module")
def check_config_output() -> tuple[int, dict[str, list[str]]]:
    """One ``fairstream check-config`` run over every bad file: its exit code
    and its stderr lines grouped by the file they start with."""
    proc = _cli("check-config", *map(str, FILES))
    by_file: dict[str, list[str]] = {p.name: [] for p in FILES}
    current: str | None = None
    for line in proc.stderr.splitlines():
        for p in FILES:
            if line.startswith(f"{p}:"):
                current = p.name
                break
        if current is not None and line.strip():
            by_file[current].append(line)
    return proc.returncode, by_file


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from router.cli import main; main()", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


@pytest.mark.parametrize("path", _params(CLI_BUGS))
def test_check_config_exits_1_and_prints_the_error(path: Path, check_config_output) -> None:
    code, by_file = check_config_output
    assert code == 1
    lines = by_file[path.name]
    assert len(lines) == 1, lines or f"no error printed for {path.name}"
    check_error_line(path, lines[0])


def test_check_config_accepts_the_shipped_configs() -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))
    assert "configs/router.yaml" in files and "configs/tenants.yaml" in files
    proc = _cli("check-config", *files)
    assert proc.returncode == 0, proc.stderr
    for f in files:
        assert re.search(rf"^{re.escape(f)}: ok\b", proc.stdout, re.M), proc.stdout
    assert "configs/router.yaml: ok (router config)" in proc.stdout
    assert "configs/tenants.yaml: ok (tenants config)" in proc.stdout


def test_check_config_reports_every_bad_file_in_one_run() -> None:
    paths = [BAD / "unknown_top_key.yaml", ROOT / "configs" / "router.yaml", BAD / "tenants_bad_digest.yaml"]
    proc = _cli("check-config", *map(str, paths))
    assert proc.returncode == 1
    assert f"{paths[1]}: ok" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if ": note: " not in line]  # (notes are no errors)
    assert len(errors) == 2, proc.stderr
    # (the tenants file router.yaml names is not checked: the one given stands for it, as with serve --tenants)
    assert f"{ROOT / 'configs' / 'tenants.yaml'}: note: not checked" in proc.stderr, proc.stderr
    check_error_line(paths[0], errors[0])
    check_error_line(paths[2], errors[1])


def test_check_config_a_tenants_file_that_does_not_parse_stands_for_router_yamls() -> None:
    """A tenants file given beside router.yaml is checked in its place (as
    ``serve --tenants``), also when it does not parse: its name says what it
    is, and the file router.yaml names is not checked as well."""
    paths = [ROOT / "configs" / "router.yaml", BAD / "tenants_unclosed_quote.yaml"]
    proc = _cli("check-config", *map(str, paths))
    assert proc.returncode == 1
    assert f"{ROOT / 'configs' / 'tenants.yaml'}: note: not checked" in proc.stderr, proc.stderr
    assert "configs/tenants.yaml: ok" not in proc.stdout, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if ": note: " not in line]
    assert len(errors) == 1, proc.stderr
    check_error_line(paths[1], errors[0])


def test_serve_refuses_a_bad_config_with_the_same_message() -> None:
    path = BAD / "unknown_top_key.yaml"
    proc = _cli("serve", "--config", str(path), "--port", "1", timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{path}:4: max_body_size: unknown key")


def test_unreadable_file_is_reported_not_raised(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_yaml(missing, RouterConfig)
    assert info.value.errors[0].startswith(f"{missing}:1: (file): cannot read")


MERGE_TENANTS = """\
priority_classes: [high, normal, low]
tenants:
  gold: &base
    keys: [3fbbe35488b29430f051abdd56e782a4d9b60e719910a9c0c723c8b34034ab13]
    priority: high
    weight: 3
  silver:
    <<: *base
    keys: [564b8ad4cd0ff69b21cf4236633b19f3099c58bbd12a0a84b03e02e4c24f69db]
    priority: normal
"""


def test_a_merge_key_with_an_override_is_not_a_duplicate(tmp_path):
    # YAML merge keys (<<:) with a local override: what they are for
    p = tmp_path / "tenants.yaml"
    p.write_text(MERGE_TENANTS)
    file, _ = load_yaml(p, TenantsFile)
    assert file.tenants["silver"].priority == "normal" and file.tenants["silver"].weight == 3


def test_a_workers_config_of_replicas_with_gpu_and_env_is_valid(tmp_path: Path) -> None:
    # (--workers turned each local replica into an address replica, keeping
    # gpu and env, which an address replica refuses: serve --workers crashed
    # at start with the documented multi-GPU setup)
    import msgspec

    from router.workers import worker_config

    (tmp_path / "router.yaml").write_text(
        "state: {backend: redis}\nreplicas:\n"
        "  - {name: gpu-0, engine: vllm, gpu: 1, env: {VLLM_CPU_OMP_THREADS_BIND: '0-1'}, config: {model: /models/m}}\n"
        "  - {name: far, address: '10.0.0.7:7000'}\n")
    config, _ = load_yaml(tmp_path / "router.yaml", RouterConfig)
    workers = worker_config(config, str(tmp_path))
    again = msgspec.json.decode(msgspec.json.encode(workers), type=RouterConfig)  # (as a worker reads it)
    assert [r.address for r in again.replicas] == [f"unix:{tmp_path}/gpu-0.sock", "10.0.0.7:7000"]
    assert again.replicas[0].gpu is None and again.replicas[0].env == {}


def test_a_remote_replica_may_be_named_as_its_host() -> None:
    # (the name rule is for the socket file of a replica the router starts)
    import msgspec

    from replicas.spec import ReplicaSpec

    names = ["10.0.0.7:7000", "fairstream-replica-0.fairstream-replica.default.svc.cluster.local", "gpu box 7"]
    for name in names:
        assert msgspec.convert({"name": name, "address": "10.0.0.7:7000"}, ReplicaSpec).name == name
    for bad in ("", " ", "a\nb"):
        try:
            msgspec.convert({"name": bad, "address": "10.0.0.7:7000"}, ReplicaSpec)
        except msgspec.ValidationError as e:
            assert "printable and not blank" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
