"""router/policy.py: live reload follows the file however it is deployed:
a symlink into another directory, a Kubernetes ConfigMap's ``..data`` swap."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from router.policy import PolicyRegistry
from tests.helpers import DEMO_TENANTS, apoll

TEXT = DEMO_TENANTS.read_text()
CHANGED = TEXT.replace("weight: 3", "weight: 4", 1)
assert CHANGED != TEXT


async def _reloads(registry: PolicyRegistry, change) -> None:
    await registry.start()
    try:
        await asyncio.sleep(1.0)  # (the watcher sets itself up)
        change()
        await apoll(lambda: registry.current.version == 2, 10, what="the reload")
    finally:
        await registry.close()


async def test_a_symlink_to_a_file_in_another_directory_is_followed(tmp_path: Path) -> None:
    # (only the link's directory was watched: an edit of the file it points
    # to was never seen, until a SIGHUP)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    real = tmp_path / "real" / "tenants.yaml"
    real.write_text(TEXT)
    link = tmp_path / "link" / "tenants.yaml"
    link.symlink_to(real)
    await _reloads(PolicyRegistry(link), lambda: real.write_text(CHANGED))


async def test_a_configmap_swap_is_followed(tmp_path: Path) -> None:
    # tenants.yaml -> ..data/tenants.yaml, ..data -> ..2026_11_30_1; kubelet
    # writes a new timestamped directory and renames a new ..data link over the old
    first = tmp_path / "..2026_11_30_1"
    first.mkdir()
    (first / "tenants.yaml").write_text(TEXT)
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "tenants.yaml").symlink_to("..data/tenants.yaml")

    def swap() -> None:
        second = tmp_path / "..2026_11_30_2"
        second.mkdir()
        (second / "tenants.yaml").write_text(CHANGED)
        (tmp_path / "..data_tmp").symlink_to(second.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

    await _reloads(PolicyRegistry(tmp_path / "tenants.yaml"), swap)


async def test_a_symlink_into_a_subdirectory_is_followed(tmp_path: Path) -> None:
    # (with the link's directory watched without recursion, an edit below it went unseen)
    (tmp_path / "envs").mkdir()
    real = tmp_path / "envs" / "tenants.yaml"
    real.write_text(TEXT)
    (tmp_path / "tenants.yaml").symlink_to(real)
    await _reloads(PolicyRegistry(tmp_path / "tenants.yaml"), lambda: real.write_text(CHANGED))


async def test_a_change_before_the_watcher_started_is_read_at_start(tmp_path: Path) -> None:
    # (the file is read when the registry is made; a change, or a SIGHUP,
    # before its watcher and handler were in was lost for good)
    path = tmp_path / "tenants.yaml"
    path.write_text(TEXT)
    registry = PolicyRegistry(path)
    path.write_text(CHANGED)
    await registry.start()
    try:
        assert registry.current.version == 2
    finally:
        await registry.close()


async def test_a_file_written_in_two_steps_0_15_s_apart_is_applied_whole(tmp_path: Path) -> None:
    # README: "the watcher applies what it reads 0.2 s after the last change";
    # it applied it 0.05 s after (watchfiles' step), so a save in two writes
    # 0.1 s apart removed the tenants of the second half (their waiting
    # requests got 401) until the rest landed
    path = tmp_path / "tenants.yaml"
    path.write_text(TEXT)
    seen: list[set[str]] = []
    registry = PolicyRegistry(path, on_reload=lambda ok, changed: seen.append(set(registry.current.tenants)))
    await registry.start()
    try:
        await asyncio.sleep(1.0)  # (the watcher sets itself up)
        whole = CHANGED
        cut = whole.index("  free:")  # the first half is valid YAML without tenant 'free'
        with open(path, "w") as f:
            f.write(whole[:cut])
            f.flush()
            await asyncio.sleep(0.15)
            f.write(whole[cut:])
        await apoll(lambda: registry.current.version == 2, 10, what="the reload")
        await asyncio.sleep(0.5)
        assert all("free" in names for names in seen), seen
        assert registry.current.version == 2
    finally:
        await registry.close()
