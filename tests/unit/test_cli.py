"""The ``fairstream`` command's own surface: ``--version``, a missing command,
``--help`` texts and defaults, and ``hash-key`` reading the key from stdin or
a prompt. Each case runs the command as a process, as a user would."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import select
import subprocess
import sys
import time

import pytest

from router import cli
from tests.helpers import ROOT

COMMANDS = ["serve", "replica", "check-config", "hash-key"]


def _cli(*args: str, stdin: str = "", timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from router.cli import main; main()", *args],
        input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
    )


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_ctrl_c_before_a_command_has_its_own_handling_exits_130_without_a_traceback(monkeypatch) -> None:
    # (a Ctrl-C in serve's first 0.7 s, while it imports, printed a traceback through the imports)
    from router import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_check", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["check-config", "configs/router.yaml"])
    assert e.value.code == 130


def test_version() -> None:
    proc = _cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"fairstream {importlib.metadata.version('fairstream')}\n"


def test_python_dash_m_runs_the_command_line_as_fairstream_does() -> None:
    # (it exited 0 having done nothing: no __main__ guard)
    proc = subprocess.run([sys.executable, "-m", "router.cli", "--version"], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"fairstream {importlib.metadata.version('fairstream')}\n"


def test_version_of_a_tree_never_installed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == "fairstream unknown (not installed)\n"


def test_no_command_names_the_commands() -> None:
    proc = _cli()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: fairstream ")
    assert proc.stderr.splitlines()[-1] == f"fairstream: error: a command is required: {', '.join(COMMANDS)}"
    assert "cmd" not in proc.stderr


@pytest.mark.parametrize(
    ("command", "lines"),
    [
        ("serve", [
            "--config FILE router config file (default: configs/router.yaml)",
            "--host HOST address to listen on (default: host in router.yaml)",
            "--port PORT port to listen on, 0 for any free one (default: port in router.yaml)",
            "--workers N router processes sharing the port (needs Redis) (default: 1)",
            "least severe level logged (default: info)",
        ]),
        ("replica", [
            "--engine {sim,vllm} the built-in simulator or vLLM (default: sim)",
            "--config-json JSON engine settings as a JSON object (default: {})",
            "(default: FAIRSTREAM_REPLICA_SECRET)",
        ]),
        ("hash-key", ["KEY the API key, or '-' to read it from stdin"]),
    ],
)
def test_help_says_what_options_do_and_their_defaults(command: str, lines: list[str]) -> None:
    proc = _cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # however argparse aligns the columns
    for line in lines:
        assert line in text, proc.stdout


def test_every_option_has_help_and_shows_its_default() -> None:
    _, commands = cli._parser()
    assert list(commands) == COMMANDS
    for name, parser in commands.items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            what = f"{name} {action.option_strings or action.dest}"
            assert action.help, f"{what} has no help"
            if action.default not in (None, False):
                assert "default" in action.help, f"{what} does not show its default"


@pytest.mark.parametrize(
    ("args", "stdin"),
    [(["-"], "KEY\n"), (["-"], "  KEY \r\n"), ([], "KEY\n"), ([], "KEY"), ([" KEY "], "")],
    ids=["dash", "dash-whitespace", "piped", "piped-no-newline", "argument-whitespace"],
)
def test_hash_key_reads_the_key_from_stdin(args: list[str], stdin: str) -> None:
    proc = _cli("hash-key", *args, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{_digest('KEY')}\n"
    assert proc.stdout == _cli("hash-key", "KEY").stdout  # the same digest as the argument gives


@pytest.mark.parametrize(
    ("args", "stdin", "error"),
    [
        (["-"], "", "the key is empty"),
        ([], " \n", "the key is empty"),
        ([""], "", "the key is empty"),
        (["-"], "KEY1\nKEY2\n", "the key spans several lines"),
        # no header can carry them (they hashed, and the key worked over the WebSocket only)
        (["sk-a\x01b"], "", "the key has a control character ('\\x01')"),
        (["sk-\x1b[0m"], "", "the key has a control character ('\\x1b')"),
    ],
    ids=["dash-nothing", "piped-blank", "empty-argument", "two-lines", "control", "escape"],
)
def test_hash_key_refuses_a_key_no_client_can_send(args: list[str], stdin: str, error: str) -> None:
    proc = _cli("hash-key", *args, stdin=stdin)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"fairstream hash-key: error: {error}"), proc.stderr


def test_hash_key_hashes_a_non_ascii_key_as_utf8_and_says_which_clients_cannot_send_it() -> None:
    proc = _cli("hash-key", "sk-ключ-юникод")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{_digest('sk-ключ-юникод')}\n"  # (UTF-8, as the router reads the header)
    assert "not ASCII" in proc.stderr and "httpx" in proc.stderr, proc.stderr
    assert "requests, browsers' fetch and Node (only characters up to U+00FF) cannot" in proc.stderr
    assert _cli("hash-key", "sk-ascii").stderr == ""
    # (one within latin-1: requests, fetch and Node send it, as latin-1 bytes the router reads)
    latin1 = _cli("hash-key", "sk-café").stderr
    assert "curl, requests, browsers' fetch, Node and the WebSocket" in latin1, latin1
    assert "the openai SDK and httpx (given it as text) cannot" in latin1, latin1


def test_hash_key_prompts_at_a_terminal() -> None:
    """stdin a terminal and no KEY: getpass asks. In its own session the child
    has no /dev/tty, so getpass prompts on stderr and reads the pty on stdin,
    echo off."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from router.cli import main; main()", "hash-key"],
            stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True,
        )
        os.close(slave)
        try:
            prompt = b""
            deadline = time.monotonic() + 30
            # Type only after the prompt: getpass flushes pending input when it turns echo off.
            while b"API key: " not in prompt and time.monotonic() < deadline:
                if select.select([proc.stderr], [], [], 0.1)[0]:
                    chunk = os.read(proc.stderr.fileno(), 1024)
                    if not chunk:
                        break
                    prompt += chunk
            assert prompt == b"API key: ", prompt
            os.write(master, b"KEY\n")
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    assert out.decode() == f"{_digest('KEY')}\n"


def test_serve_refuses_an_unset_replica_secret(tmp_path) -> None:
    (tmp_path / "router.yaml").write_text(
        "tenants: " + str(ROOT / "configs" / "tenants.yaml") + "\n"
        "replicas:\n  - {name: gpu0, address: '127.0.0.1:9', secret_env: FS_TEST_UNSET_SECRET}\n")
    env = {k: v for k, v in os.environ.items() if k != "FS_TEST_UNSET_SECRET"}
    proc = subprocess.run([sys.executable, "-c", "from router.cli import main; main()", "serve", "--config",
                           str(tmp_path / "router.yaml")], capture_output=True, text=True, timeout=30, env=env,
                          cwd=ROOT, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "FS_TEST_UNSET_SECRET" in proc.stderr and "is not set" in proc.stderr
    # check-config passes the file (it may run where the secrets are not) and says what serve will do
    check = subprocess.run([sys.executable, "-c", "from router.cli import main; main()", "check-config",
                            str(tmp_path / "router.yaml")], capture_output=True, text=True, timeout=30, env=env,
                           cwd=ROOT, check=False)
    assert check.returncode == 0, check.stderr
    assert ": ok (router config)\n" in check.stdout, check.stdout
    assert "note: FS_TEST_UNSET_SECRET" in check.stderr and "refuses to start" in check.stderr, check.stderr


def test_serve_that_cannot_listen_names_the_address() -> None:
    # (it logged "[Errno -2] Name or service not known" and nothing else)
    proc = _cli("serve", "--host", "no-such-host.invalid", "--port", str(_free_port()), "--log-format", "text",
                timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    # (the reason on the same line: uvicorn's own line of it comes before the router's stop lines)
    line = next((s for s in proc.stderr.splitlines() if "cannot listen on no-such-host.invalid:" in s), "")
    assert "Name or service not known" in line or "Temporary failure in name resolution" in line, proc.stderr


def test_check_config_notes_an_unset_api_key_env(tmp_path) -> None:
    # (serve started, and the upstream refused every request with a 401 that named no variable)
    (tmp_path / "router.yaml").write_text(
        "tenants: " + str(ROOT / "configs" / "tenants.yaml") + "\n"
        "replicas:\n  - {name: up, url: 'http://127.0.0.1:9/v1', api_key_env: FS_TEST_UNSET_KEY}\n")
    env = {k: v for k, v in os.environ.items() if k != "FS_TEST_UNSET_KEY"}
    check = subprocess.run([sys.executable, "-c", "from router.cli import main; main()", "check-config",
                            str(tmp_path / "router.yaml")], capture_output=True, text=True, timeout=30, env=env,
                           cwd=ROOT, check=False)
    assert check.returncode == 0, check.stderr
    assert "note: FS_TEST_UNSET_KEY (a url replica's api_key_env) is not set" in check.stderr, check.stderr


def _replica_log(listen: str) -> str:
    """The first lines a replica run by hand logs, until it is ready (or fails)."""
    env = {k: v for k, v in os.environ.items() if k != "FAIRSTREAM_REPLICA_SECRET"}
    proc = subprocess.Popen([sys.executable, "-c", "from router.cli import main; main()", "replica", "--engine",
                             "sim", "--listen", listen], stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    out = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            out.append(line)
            if "replica ready on" in line:
                break
    finally:
        proc.kill()
        proc.wait(10)
    return "".join(out)


def test_a_replica_open_to_the_network_without_a_secret_says_so() -> None:
    port = _free_port()
    log = _replica_log(f"0.0.0.0:{port}")
    assert "replica ready on" in log, log
    assert "without a secret" in log and "FAIRSTREAM_REPLICA_SECRET" in log, log
    assert "without a secret" not in _replica_log(f"127.0.0.1:{_free_port()}")
    assert "without a secret" not in _replica_log(f":{_free_port()}")  # (binds 127.0.0.1)


@pytest.mark.parametrize("flag", [["--no-token-ids"], ["--stream-interval", "4"]])
def test_the_openai_only_replica_flags_are_refused_without_openai(tmp_path, flag: list[str]) -> None:
    # (they were accepted and ignored on the replica protocol)
    proc = _cli("replica", "--engine", "sim", "--socket", str(tmp_path / "r.sock"), *flag, timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("--no-token-ids and --stream-interval apply to --openai only"), proc.stderr


@pytest.mark.parametrize(("args", "error"), [
    (["--listen", "bogus"], "--listen: 'bogus' is not HOST:PORT (port 0-65535"),  # (int() traceback)
    (["--listen", "::1"], "'::1' is not HOST:PORT (port 0-65535; an IPv6 host in brackets, [::1]:7000)"),  # (port 1)
    (["--listen", "127.0.0.1:99999"], "--listen: '127.0.0.1:99999' is not HOST:PORT"),  # (listened on 34463)
    (["--socket", "/nonexistent/dir/r.sock"], "--socket: no directory '/nonexistent/dir' to put the socket in"),
    (["--socket", "r.sock", "--config-json", "{bad"], "--config-json is not JSON: "),
    (["--socket", "r.sock", "--config-json", "[]"], "--config-json must be a JSON object"),
])
def test_a_replica_started_wrong_says_what_is_wrong(args: list[str], error: str) -> None:
    proc = _cli("replica", *args, timeout=30)
    assert proc.returncode == 1 and error in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_replica_with_a_bad_setting_or_a_taken_port_fails_in_one_line(tmp_path) -> None:
    import socket

    for args in (["--socket", str(tmp_path / "r.sock"), "--config-json", '{"block_size": 0}'],
                 ["--listen", "127.0.0.1:PORT"]):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            args = [a.replace("PORT", str(taken.getsockname()[1])) for a in args]
            proc = _cli("replica", "--log-format", "text", *args, timeout=30)
        assert proc.returncode == 1 and "replica failed: " in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "block_size` must be at least 1" in proc.stderr or "address already in use" in proc.stderr


def test_a_bracketed_ipv6_listen_address_works() -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = _free_port()
    log = _replica_log(f"[::1]:{port}")
    # (the line names the address as --listen and router.yaml take it: "::1:PORT" is refused there)
    assert f"replica ready on [::1]:{port}" in log and "Traceback" not in log, log


def _free_port() -> int:
    from tests.helpers import free_port

    return free_port()


def test_a_replica_that_cannot_start_says_why_in_one_log_line() -> None:
    # (an untagged traceback on stderr was all there was; the supervisor
    # only logs the exit status)
    proc = subprocess.run(
        [sys.executable, "-c", "from router.cli import main; main()", "replica", "--engine", "vllm",
         "--listen", f"127.0.0.1:{_free_port()}", "--config-json", '{"model": "/nonexistent/model-dir"}'],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "FAIRSTREAM_REPLICA_NAME": "vllm-x", "FAIRSTREAM_LOG_FORMAT": "json"})
    assert proc.returncode == 1
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    failed = [line for line in lines if line["msg"].startswith("replica failed: EngineError: ")]
    assert len(failed) == 1 and failed[0]["level"] == "error" and failed[0]["replica"] == "vllm-x", proc.stderr
    # whether vllm is installed here or not, the line names the cause
    assert ("model directory /nonexistent/model-dir does not exist" in failed[0]["msg"]
            or "vllm is not installed" in failed[0]["msg"]), failed
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "error"), [
    (["--port", "99999"], "argument --port: 99999 is not a port (0-65535)"),  # (it wrapped round to 34463)
    (["--port", "-1"], "argument --port: -1 is not a port (0-65535)"),
    (["--port", "http"], "argument --port: 'http' is not an integer"),
    (["--workers", "0"], "argument --workers: must be at least 1, not 0"),  # (taken as 1)
])
def test_serve_refuses_a_port_or_worker_count_out_of_range(args: list[str], error: str) -> None:
    proc = _cli("serve", *args)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == f"fairstream serve: error: {error}", proc.stderr


@pytest.mark.parametrize(("text", "kind"), [
    ("tenants:\n", "tenants"), ("tenants: [gold]\n", "tenants"), ("priority_classes: [a]\n", "tenants"),
    ("tenants: t.yaml\nreplicas: []\n", "router"), ("port: 1\n", "router"), ("tenants: t.yaml\n", "router"),
])
def test_check_config_tells_a_broken_tenants_file_by_its_keys(tmp_path, text: str, kind: str) -> None:
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    path = tmp_path / "f.yaml"
    path.write_text(text)
    assert cli._config_kind(str(path)) is (TenantsFile if kind == "tenants" else RouterConfig)


@pytest.mark.parametrize(("name", "kind"), [("tenants.yaml", "tenants"), ("my-Tenants.yml", "tenants"),
                                            ("router.yaml", "router"), ("x.yaml", "router")])
def test_check_config_tells_an_empty_file_by_its_name(tmp_path, name: str, kind: str) -> None:
    # (an empty tenants.yaml was checked as a router file: "missing required
    # key replicas", where a reload of it says "missing required key tenants")
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    path = tmp_path / name
    path.write_text("# nothing yet\n")
    assert cli._config_kind(str(path)) is (TenantsFile if kind == "tenants" else RouterConfig)


def test_check_config_checks_the_tenants_file_router_yaml_names(tmp_path) -> None:
    # (it said "ok" of a router.yaml whose tenants file does not exist; serve then refused to start)
    (tmp_path / "router.yaml").write_text("tenants: missing.yaml\nreplicas:\n  - {name: sim-0, engine: sim}\n")
    proc = _cli("check-config", str(tmp_path / "router.yaml"))
    assert proc.returncode == 1, proc.stdout
    assert "missing.yaml:1: (file): cannot read" in proc.stderr, proc.stderr
    (tmp_path / "missing.yaml").write_text((ROOT / "configs" / "tenants.yaml").read_text())
    proc = _cli("check-config", str(tmp_path / "router.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{tmp_path / 'router.yaml'}: ok (router config)",
                                        f"{tmp_path / 'missing.yaml'}: ok (tenants config)"], proc.stdout
    proc = _cli("check-config", str(tmp_path / "router.yaml"), str(tmp_path / "missing.yaml"))  # (once, not twice)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2, proc.stdout


def test_check_config_takes_a_tenants_file_given_for_the_one_router_yaml_names(tmp_path) -> None:
    # (serve --tenants FILE runs a router.yaml whose default tenants.yaml does not exist;
    # check-config of the two said "cannot read" of that default and exited 1)
    (tmp_path / "app").mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "app" / "router.yaml").write_text("replicas:\n  - {name: sim-0, engine: sim}\n")
    (tmp_path / "etc" / "tenants.yaml").write_text((ROOT / "configs" / "tenants.yaml").read_text())
    proc = _cli("check-config", str(tmp_path / "app" / "router.yaml"), str(tmp_path / "etc" / "tenants.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "cannot read" not in proc.stderr, proc.stderr


def test_check_config_checks_a_tenants_file_once_however_router_yaml_is_spelled(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "router.yaml").write_text("replicas:\n  - {name: sim-0, engine: sim}\n")
    (tmp_path / "tenants.yaml").write_text((ROOT / "configs" / "tenants.yaml").read_text())
    proc = _cli("check-config", str(tmp_path / "router.yaml"), str(tmp_path / "sub" / ".." / "router.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert sum("(tenants config)" in line for line in proc.stdout.splitlines()) == 1, proc.stdout


@pytest.mark.parametrize(("line", "edit"), [
    (26, ("gold:", "gold")),  # (the parser reads the top-level keys before the error: tenants is a mapping)
    (5, ("admin_keys:", "admin_keys")),  # (nothing can be read: it stands beside a router.yaml)
])
def test_check_config_takes_a_broken_tenants_file_given_for_the_one_router_yaml_names(
        tmp_path, line: int, edit: tuple[str, str]) -> None:
    # (a tenants file that did not parse and had no "tenant" in its name was
    # taken for a router config: router.yaml's own tenants file was checked
    # too, and "ok" printed next to the given file's error)
    lines = (ROOT / "configs" / "tenants.yaml").read_text().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].replace(*edit)
    (tmp_path / "policy.yaml").write_text("".join(lines))
    proc = _cli("check-config", "configs/router.yaml", str(tmp_path / "policy.yaml"))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["configs/router.yaml: ok (router config)"], proc.stdout
    assert f"{tmp_path / 'policy.yaml'}:{line}: (syntax): a ':' is missing after a key" in proc.stderr, proc.stderr
    assert "configs/tenants.yaml: note: not checked" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("text", "kind"), [
    ("admin_keys: []\ntenants:\n  gold\n    keys: [x]\n", "tenants"),
    ("host: 1.2.3.4\ntenants: t.yaml\nport 80\n  x: 1\n", "router"),
    ("port: 1\nreplicas:\n  - name sim-0\n    engine: sim\n", "router"),
    # (an unprintable character after the keys: PyYAML's own reader refuses the whole text at once)
    ("admin_keys: []\ntenants:\n  a:\n    keys: [x]\n# \x01\n", "tenants"),
])
def test_check_config_tells_an_unparseable_file_by_the_keys_read_before_the_error(
        tmp_path, text: str, kind: str) -> None:
    from router.config import RouterConfig
    from router.tenants import TenantsFile

    # (named as the other kind: the name alone would tell it wrongly)
    path = tmp_path / ("router.yaml" if kind == "tenants" else "tenants.yaml")
    path.write_text(text)
    assert cli._config_kind(str(path)) is (TenantsFile if kind == "tenants" else RouterConfig)


def test_check_config_reports_an_unprintable_character_in_a_file_of_another_name(tmp_path) -> None:
    # (PyYAML's pure reader, which reads the keys before an error, refused the
    # text as it was built, outside its try: a traceback, not the error)
    (tmp_path / "policy.yaml").write_text("admin_keys: []\ntenants:\n  a:\n    keys: [x]\n# \x01\n")
    proc = _cli("check-config", "configs/router.yaml", str(tmp_path / "policy.yaml"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines() == ["configs/router.yaml: ok (router config)"], proc.stdout
    assert f"{tmp_path / 'policy.yaml'}:5: (syntax): character U+0001 at column 3: " in proc.stderr, proc.stderr
    assert "configs/tenants.yaml: note: not checked" in proc.stderr, proc.stderr


@pytest.mark.parametrize("first", [True, False], ids=["broken-first", "good-first"])
def test_check_config_tells_a_router_config_broken_at_its_first_key_by_its_other_keys(tmp_path, first: bool) -> None:
    # (no top-level key is read before the error on line 1, and the name has
    # no "router" in it: beside a good router config it was taken for the
    # tenants file, and the good one's own tenants file went unchecked, "the
    # tenants file given stands for it")
    router = (ROOT / "configs" / "router.yaml").read_text()
    (tmp_path / "router.yaml").write_text(router)
    (tmp_path / "tenants.yaml").write_text((ROOT / "configs" / "tenants.yaml").read_text())
    (tmp_path / "main.yaml").write_text("port 8080\n" + router)
    files = [str(tmp_path / "main.yaml"), str(tmp_path / "router.yaml")]
    proc = _cli("check-config", *(files if first else files[::-1]))
    assert proc.returncode == 1
    assert f"{tmp_path / 'tenants.yaml'}: ok (tenants config)" in proc.stdout.splitlines(), proc.stdout
    assert "not checked" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{tmp_path / 'main.yaml'}:1: (syntax): a ':' is missing"), proc.stderr


def test_check_config_says_when_it_cannot_tell_a_file_s_kind(tmp_path) -> None:
    # (nothing in it names a key of either kind: it is taken for the tenants
    # file given with the router config, and the note says so)
    (tmp_path / "main.yaml").write_text("[oops\n")
    proc = _cli("check-config", "configs/router.yaml", str(tmp_path / "main.yaml"))
    assert proc.returncode == 1
    assert f"{tmp_path / 'main.yaml'}: note: no top-level key can be read to tell a router config from a tenants " \
        "file; taken for the tenants file given with a router config" in proc.stderr, proc.stderr


def test_check_config_tells_the_kind_by_a_key_on_line_1_after_a_byte_order_mark(tmp_path, monkeypatch) -> None:
    # (the file was read as 'utf-8': the mark stayed before line 1's key, which
    # the keys written at the start of a line, read when the parser read none,
    # then missed; a parser that reads no key stands in for a line-1 error)
    from router.config import RouterConfig

    path = tmp_path / "f.yaml"
    path.write_text("\ufeffport: 1\n", encoding="utf-8")
    monkeypatch.setattr(cli, "_keys_before_error", lambda text: {})
    assert cli._config_kind(str(path), beside_router=True) is RouterConfig
