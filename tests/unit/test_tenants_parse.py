"""A reload's parse in a child process (router.tenants_parse) gives what
load_yaml gives in the router's own process: the same file, or the same
``file:line: key: reason`` errors (those check-config prints)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from ops.bench_reload import tenants_text
from router.configfile import ConfigError, load_yaml
import router.policy as policy_module
from router.policy import PolicyRegistry
from router.tenants import TenantsFile
from router.tenants_parse import ParseUnavailable, decode, parse_elsewhere

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tenants.yaml"


@pytest.mark.parametrize("text", [DEMO.read_text(), tenants_text(300)], ids=["demo", "generated"])
async def test_a_valid_file_comes_back_as_parsed_here(tmp_path, text):
    path = tmp_path / "tenants.yaml"
    assert decode(await parse_elsewhere(path, text), path) == load_yaml(path, TenantsFile, text)[0]


@pytest.mark.parametrize("bad", [
    DEMO.read_text().replace("weight: 3", "weight: x").replace("  timeouts:", "  timeoutz:", 1),
    "tenants:\n  a\n    keys: []\n",  # (a syntax error)
    "a: &a [1]\n" + "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}, *a, *a, *a, *a, *a, *a, *a]\n"
                            for i in range(9)),
])
async def test_a_bad_file_gets_the_errors_it_gets_here(tmp_path, bad):
    path = tmp_path / "tenants.yaml"
    with pytest.raises(ConfigError) as here:
        load_yaml(path, TenantsFile, bad)
    with pytest.raises(ConfigError) as there:
        decode(await parse_elsewhere(path, bad), path)
    assert there.value.errors == here.value.errors and here.value.errors


async def test_a_reload_that_cannot_start_the_parse_fails_then_is_tried_again(tmp_path):
    # (near the open-file limit the child's pipes cannot be made: the OSError
    # escaped the reload, a 500 for POST /admin/reload, and the watcher never
    # applied the edit; counted nowhere, last_reload_errors empty)
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO.read_text())
    registry = PolicyRegistry(path)
    registry.retry_first = 0.2
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: 4"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        os.close(held.pop())  # (one left: the file is read, the child's pipes are not made)
        result = await registry.reload()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not result.ok and registry.current.version == 1
    assert registry.last_errors == result.errors
    [error] = result.errors
    assert error.startswith(f"{path}:1: (file): ") and "Too many open files" in error
    # the registry tries again on its own: the edit applies without another
    # change of the file (the watcher saw this one already), SIGHUP or POST
    for _ in range(100):
        if registry.current.version == 2:
            break
        await asyncio.sleep(0.05)
    assert registry.current.version == 2 and registry.last_errors == []
    assert registry.current.tenants["gold"].weight == 4
    await registry.close()


async def test_a_bad_file_is_not_tried_again(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO.read_text())
    registry = PolicyRegistry(path)
    registry.retry_first = 0.05
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: x"))
    assert not (await registry.reload()).ok
    assert registry._retry is None
    await registry.close()


@pytest.mark.parametrize("answer", [msgspec.msgpack.encode({"file": {"tenants": 5}}), b"\xc1"],
                         ids=["other-structs", "not-msgpack"])
def test_an_answer_this_router_cannot_read_is_a_config_error(tmp_path, answer):
    path = tmp_path / "tenants.yaml"
    with pytest.raises(ConfigError) as e:
        decode(answer, path)
    [error] = e.value.errors
    assert error.startswith(f"{path}:1: (file): ") and "restart the router" in error


async def test_the_child_runs_this_routers_code_not_a_router_package_in_the_cwd(tmp_path, monkeypatch):
    # (``-m`` put the cwd first on sys.path: a ``router/`` there was what the child ran)
    for where in (tmp_path / "cwd", tmp_path / "pythonpath"):
        (where / "router").mkdir(parents=True)
        (where / "router" / "__init__.py").write_text("")
        (where / "router" / "tenants_parse.py").write_text(
            "import sys\nsys.stdout.buffer.write(b'\\x81\\xa6errors\\x91\\xa5other')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pythonpath"))
    text = DEMO.read_text()
    path = tmp_path / "tenants.yaml"
    assert decode(await parse_elsewhere(path, text), path) == load_yaml(path, TenantsFile, text)[0]


async def test_a_path_that_is_not_utf8_gets_the_errors_it_gets_here(tmp_path):
    # (its errors held lone surrogates, which the child's msgpack could not encode)
    path = Path(os.fsdecode(os.fsencode(tmp_path) + b"/tenants-\xff.yaml"))
    bad = DEMO.read_text().replace("weight: 3", "weight: x")
    with pytest.raises(ConfigError) as here:
        load_yaml(path, TenantsFile, bad)
    with pytest.raises(ConfigError) as there:
        decode(await parse_elsewhere(path, bad), path)
    assert there.value.errors == here.value.errors and here.value.errors


def test_the_child_dies_with_the_router(tmp_path):
    # (a router killed mid-parse left the child parsing a large file to the end)
    marker = str(tmp_path / "marker.yaml")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import asyncio, sys; from pathlib import Path;"
         "from ops.bench_reload import tenants_text; from router.tenants_parse import parse_elsewhere;"
         "asyncio.run(parse_elsewhere(Path(sys.argv[1]), tenants_text(40000)))", marker],
        cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (child := _running_with(marker)):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # (its input written: it is parsing)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 1.5  # (the parse takes several seconds more)
    while _running_with(marker) == child:
        assert time.monotonic() < deadline, "the parse process outlived the router"
        time.sleep(0.05)


def _running_with(arg: str) -> int | None:
    """The pid of a live (not zombie) parse process with ``arg`` in its command line."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            args = set((proc / "cmdline").read_bytes().split(b"\0"))
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if {b"router.tenants_parse", arg.encode()} <= args and state != "Z":
                return int(proc.name)
        except OSError:
            continue
    return None


async def test_close_cancels_a_retry_that_is_reloading(tmp_path, monkeypatch):
    # (the retry let go of its task before it reloaded: a close then missed
    # it, and the reload swapped the policy in after the router's close)
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO.read_text())
    calls: list[tuple[bool, bool]] = []
    registry = PolicyRegistry(path, on_reload=lambda ok, changed: calls.append((ok, changed)))
    registry.retry_first = 0.05
    tries = 0

    async def parse(p, text):
        nonlocal tries
        tries += 1
        if tries == 1:
            raise ParseUnavailable([f"{p}:1: (file): cannot start the process that parses it: EMFILE"])
        await asyncio.sleep(0.5)  # (a large file's parse)
        return await parse_elsewhere(p, text)

    monkeypatch.setattr(policy_module, "parse_elsewhere", parse)
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: 4"))
    assert not (await registry.reload()).ok
    await asyncio.sleep(0.2)  # (the retry is reloading)
    assert tries == 2
    await registry.close()
    await asyncio.sleep(0.6)
    assert calls == [(False, False)] and registry.current.version == 1


async def test_a_new_edit_gets_its_own_tries(tmp_path, monkeypatch):
    # (after five failed tries, a file put back and a new edit that failed
    # for the moment got no retry: the count of tries never started over)
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO.read_text())
    registry = PolicyRegistry(path)
    registry.retry_first = 0.01
    failing = True

    async def parse(p, text):
        if failing:
            raise ParseUnavailable([f"{p}:1: (file): cannot start the process that parses it: EMFILE"])
        return await parse_elsewhere(p, text)

    monkeypatch.setattr(policy_module, "parse_elsewhere", parse)
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: 4"))
    await registry.reload()
    for _ in range(100):  # (its five tries: 0.01 + 0.02 + 0.04 + 0.08 + 0.16 s)
        if registry._retries == 5 and registry._retry.done():
            break
        await asyncio.sleep(0.02)
    assert registry._retries == 5 and registry.current.version == 1
    path.write_text(DEMO.read_text())  # put back
    assert (await registry.reload()).ok
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: 5"))
    assert not (await registry.reload()).ok
    failing = False  # (the moment passed)
    for _ in range(100):
        if registry.current.version == 2:
            break
        await asyncio.sleep(0.02)
    assert registry.current.tenants["gold"].weight == 5
    await registry.close()


async def test_a_bad_file_cancels_a_retry_that_waits(tmp_path, monkeypatch):
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO.read_text())
    registry = PolicyRegistry(path)
    registry.retry_first = 0.3

    async def parse(p, text):
        if "weight: 4" in text:
            raise ParseUnavailable([f"{p}:1: (file): cannot start the process that parses it: EMFILE"])
        return await parse_elsewhere(p, text)

    monkeypatch.setattr(policy_module, "parse_elsewhere", parse)
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: 4"))
    await registry.reload()
    waiting = registry._retry
    assert waiting is not None
    path.write_text(DEMO.read_text().replace("weight: 3", "weight: x"))
    assert not (await registry.reload()).ok
    await asyncio.sleep(0)
    assert waiting.cancelled() and registry._retry is None
    await registry.close()
