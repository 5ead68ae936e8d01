"""replicas/rundirs.py: a router's run directories carry their owner, and
the sweep removes those of dead owners only (against the real /proc, in a
private temp dir)."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from replicas.rundirs import MARKER, Owner, ProcFs, make_run_dir, sweep
from tests.helpers import poll, proc_stat

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _me() -> Owner:
    owner = ProcFs().owner(os.getpid())
    assert owner is not None
    return owner


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # (reused meanwhile, it has another start time)


def _run_dir(tmp: Path, name: str, owner: Owner | None, marker: bytes | None = None) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "sim-0.sock").write_bytes(b"")
    if owner is not None:
        (d / MARKER).write_bytes(msgspec.json.encode(owner))
    elif marker is not None:
        (d / MARKER).write_bytes(marker)
    return d


def test_make_run_dir_marks_it_with_this_process_and_its_start_time(tmp_path: Path) -> None:
    d = Path(make_run_dir(tmp=str(tmp_path)))
    assert d.parent == tmp_path and d.name.startswith("fairstream-")
    owner = msgspec.json.decode((d / MARKER).read_bytes(), type=Owner)
    assert owner.pid == os.getpid()
    assert owner.start_time == proc_stat(os.getpid()).start_time
    assert sorted(os.listdir(d)) == [MARKER]  # (no half-written marker left beside it)


def test_sweep_removes_the_dirs_of_dead_owners_only(tmp_path: Path, caplog) -> None:
    me = _me()
    mine = Path(make_run_dir(tmp=str(tmp_path)))
    metrics = Path(make_run_dir("fairstream-metrics-", tmp=str(tmp_path)))
    dead = _run_dir(tmp_path, "fairstream-dead", msgspec.structs.replace(me, pid=_dead_pid()))
    (dead / "counter_123.db").write_bytes(b"x" * 100)
    dead_metrics = _run_dir(tmp_path, "fairstream-metrics-dead", msgspec.structs.replace(me, pid=_dead_pid()))
    reused = _run_dir(tmp_path, "fairstream-reused", msgspec.structs.replace(me, start_time=me.start_time - 1))
    caplog.set_level(logging.INFO, logger="fairstream.rundirs")

    assert sweep(str(tmp_path)) == 3

    assert not dead.exists() and not dead_metrics.exists() and not reused.exists()
    assert mine.is_dir() and metrics.is_dir()
    assert "removed 3 run directories" in caplog.text
    assert sweep(str(tmp_path)) == 0


@pytest.mark.parametrize("marker", [None, b"", b"{not json", b'{"pid": 1}', b'{"pid": "1", "start_time": 1}'],
                         ids=["none", "empty", "garbage", "incomplete", "wrong-type"])
def test_a_dir_without_a_valid_marker_is_left_alone(tmp_path: Path, marker: bytes | None) -> None:
    d = _run_dir(tmp_path, "fairstream-old", None, marker)
    assert sweep(str(tmp_path)) == 0
    assert (d / "sim-0.sock").exists()


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = _run_dir(elsewhere, "fairstream-target", msgspec.structs.replace(_me(), pid=_dead_pid()))
    link = tmp_path / "fairstream-x"
    link.symlink_to(target)
    # a marker that is a symlink to a dead owner's marker does not count either
    marked_by_link = _run_dir(tmp_path, "fairstream-linked-marker", None)
    (marked_by_link / MARKER).symlink_to(target / MARKER)

    assert sweep(str(tmp_path)) == 0

    assert link.is_symlink() and (target / "sim-0.sock").exists() and (target / MARKER).exists()
    assert marked_by_link.is_dir()
    assert sweep(str(elsewhere)) == 1  # (the target itself is stale)


@pytest.mark.parametrize("field", ["boot_id", "pid_ns"])
def test_a_marker_from_another_boot_or_pid_namespace_is_left_alone(tmp_path: Path, field: str) -> None:
    """There its pid names another process (or none): nothing to judge by."""
    owner = msgspec.structs.replace(_me(), pid=_dead_pid(), **{field: "elsewhere"})
    d = _run_dir(tmp_path, "fairstream-foreign", owner)
    assert sweep(str(tmp_path)) == 0
    assert d.is_dir()


def test_only_this_users_dirs(tmp_path: Path, monkeypatch) -> None:
    d = _run_dir(tmp_path, "fairstream-dead", msgspec.structs.replace(_me(), pid=_dead_pid()))
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    assert sweep(str(tmp_path)) == 0
    assert d.is_dir()


def test_other_names_are_left_alone(tmp_path: Path) -> None:
    d = _run_dir(tmp_path, "fst-dead", msgspec.structs.replace(_me(), pid=_dead_pid()))
    assert sweep(str(tmp_path)) == 0
    assert d.is_dir()


def test_a_zombie_owner_is_dead(tmp_path: Path) -> None:
    p = subprocess.Popen(["true"])
    try:
        st = poll(lambda: (s := proc_stat(p.pid)) is not None and s.state == "Z" and s, 5,
                  what="the child exited, not reaped")
        d = _run_dir(tmp_path, "fairstream-zombie", msgspec.structs.replace(_me(), pid=p.pid, start_time=st.start_time))
        assert sweep(str(tmp_path)) == 1
        assert not d.exists()
    finally:
        p.wait()


def test_without_proc_no_marker_and_no_sweep(tmp_path: Path) -> None:
    """macOS: no /proc, so no owner to write or check."""
    no_proc = ProcFs(str(tmp_path / "no-proc"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    d = Path(make_run_dir(tmp=str(tmp), proc=no_proc))
    assert os.listdir(d) == []
    dead = _run_dir(tmp, "fairstream-dead", msgspec.structs.replace(_me(), pid=_dead_pid()))
    assert sweep(str(tmp), proc=no_proc) == 0
    assert dead.is_dir() and d.is_dir()


def test_an_ipc_dir_is_made_only_where_a_uuid_named_socket_in_it_fits() -> None:
    # (AF_UNIX paths hold 107 bytes: vLLM's engine could not bind its sockets
    # in a longer one; it keeps its default, the temp dir)
    import shutil
    import tempfile

    from replicas.rundirs import make_ipc_dir

    top = tempfile.mkdtemp(prefix="fst-")  # (short: tmp_path can be too long already)
    try:
        uuid = "0166a38b-3b12-44ee-baf1-1d4aab8176da"
        longest = 107 - len("/ipc-XXXXXXXX/") - len(uuid)
        fits = os.path.join(top, "d" * (longest - len(top) - 1))
        too_long = fits + "d"
        # (no directory of its own fits, but a socket fits in the run dir itself:
        # there, removed with it, rather than in the temp dir, where nothing would)
        only_itself = os.path.join(top, "e" * (107 - len(uuid) - 1 - len(top) - 1))
        nothing = only_itself + "e"
        for d in (fits, too_long, only_itself, nothing):
            os.mkdir(d)
        ipc, own = make_ipc_dir(fits)
        assert own and os.path.dirname(ipc) == fits and os.listdir(ipc) == []
        assert len(os.path.join(ipc, uuid)) == 107
        assert make_ipc_dir(too_long) == (too_long, False)
        assert make_ipc_dir(only_itself) == (only_itself, False)
        assert len(os.path.join(only_itself, uuid)) == 107
        assert make_ipc_dir(nothing) is None
    finally:
        shutil.rmtree(top)
