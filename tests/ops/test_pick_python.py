"""ops/pick_python.py: the venv's interpreter is the fastest build of the
running Python's version, chosen only by a clear margin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
