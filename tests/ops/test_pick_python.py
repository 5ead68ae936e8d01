"""ops/pick_python.py: the venv's interpreter is the fastest build of the
running Python's version, chosen only by a clear margin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops.pick_python import MARGIN, choose

ROOT = Path(__file__).resolve().parents[2]


def test_a_faster_build_is_chosen_only_past_the_margin() -> None:
    assert choose("/a", {"/a": 1.0, "/b": 0.5}) == ("/b", "runs Python code 2.0x as fast as")
    assert choose("/a", {"/a": 1.0, "/b": 1.0 / MARGIN + 0.01}) == ("/a", None)  # (noise, not a faster build)
    assert choose("/a", {"/a": 0.5, "/b": 1.0}) == ("/a", None)


def test_one_that_cannot_make_a_venv_gives_way_and_none_at_all_keeps_it() -> None:
    assert choose("/a", {"/b": 0.9}) == ("/b", "can make a virtualenv, unlike")
    assert choose("/a", {}) == ("/a", None)


def test_it_prints_an_interpreter_of_the_same_version() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "ops" / "pick_python.py")], capture_output=True, text=True,
                         timeout=120, check=True)
    chosen = out.stdout.strip()
    version = subprocess.run([chosen, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
    assert version == str(sys.version_info[:2])


def _dry_setup(tmp_path: Path, venv: bool) -> str:
    """What ``make setup`` would run in a copy of the Makefile, with or
    without a venv already there (its install stamp older than pyproject.toml)."""
    tmp_path.mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    if venv:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        python = tmp_path / ".venv" / "bin" / "python"
        python.write_text("#!/bin/sh\n")
        python.chmod(0o755)
        (tmp_path / ".venv" / ".installed").touch()
        os.utime(tmp_path / ".venv" / ".installed", (1, 1))
    (tmp_path / "pyproject.toml").touch()
    return subprocess.run(["make", "-n", "setup", "PYTHON=/bin/false"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=True).stdout


@pytest.mark.skipif(not shutil.which("make"), reason="no make")
def test_make_setup_keeps_an_existing_venv_and_makes_a_missing_one(tmp_path: Path) -> None:
    # (made again over itself by the picker's choice, a venv python3 had made
    # was half one build and half the other: ssl did not import, and
    # make setup failed every time after)
    old = _dry_setup(tmp_path / "old", venv=True)
    assert "-m venv" not in old and "pip install" in old, old
    new = _dry_setup(tmp_path / "new", venv=False)
    assert "/bin/false -m venv .venv" in new, new
