#!/usr/bin/env bash
# Build .venv-peers: torch 2.13.0 (CPU) + verl 0.9.1 + TRL 0.24.0 + rlmath (editable),
# with only the packages that `import verl.utils.torch_functional`,
# `import verl.trainer.ppo.core_algos` and `import trl.trainer.utils` need.
# Never committed (.gitignore has `.venv-*/`). Usage, from the repository root:
#   bash tests/peers/setup_peers_env.sh            # or VENV=/some/path bash ...
#   .venv-peers/bin/python -m pytest -q tests/peers
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-peers}"
PY="$VENV/bin/python"

test -x "$PY" || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip

# 1. torch first, pinned, and a constraints file so no later step can replace it
#    (a bare `torch` requirement would pull the multi-GB CUDA build).
"$PY" -m pip install -q torch==2.13.0
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" >"$CONSTRAINTS"
PIP=("$PY" -m pip install -q -c "$CONSTRAINTS")

# 2. verl 0.9.1 without its (huge) dependency list, then what its math modules import:
#    verl/__init__ -> verl.protocol -> ray, tensordict, numpy, packaging;
#    torch_functional -> transformers; core_algos -> omegaconf; verl.utils -> codetiming.
#    Versions satisfy verl's metadata (tensordict>=0.8,<=0.10,!=0.9.0; transformers>=5.5.3,<5.11).
"${PIP[@]}" --no-deps verl==0.9.1
"${PIP[@]}" packaging "numpy>=2.0.0" "ray>=2.41.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
  "transformers>=5.5.3,<5.11,!=5.6.0" omegaconf codetiming
#    verl's trainer and workers (test_compat_verl_workers.py: ray_trainer.compute_advantage,
#    the FSDP engine's actor and critic on CPU) import these too.
"${PIP[@]}" torchdata==0.11.0 tqdm==4.70.1 uvicorn==0.55.0 fastapi==0.165.0 \
  dill==0.4.1 peft==0.21.2 pillow==13.0.0 cachetools==8.0.2

# 3. TRL 0.24.0 without deps; trl.trainer.utils imports accelerate and pandas, and
#    trl.trainer.grpo_trainer (the GRPO algorithm comparisons) imports datasets.
"${PIP[@]}" --no-deps trl==0.24.0
"${PIP[@]}" "accelerate>=1.4.0" pandas datasets

# 4. rlmath itself (editable) and the test tools; `parameterized` is what TRL's own tests
#    (copied in tests/peers/trl_0_24_0/) use.
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" "pytest>=7" "hypothesis>=6.80" numpy parameterized

# 5. Check: torch is still the pinned CPU build and every peer imports.
"$PY" - <<'PY'
import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
import trl.trainer.utils  # noqa: F401
import verl.trainer.ppo.core_algos  # noqa: F401
import verl.utils.torch_functional  # noqa: F401
import verl.trainer.ppo.ray_trainer  # noqa: F401
import verl.workers.engine_workers  # noqa: F401

import rlmath  # noqa: F401

print("peers env ready: torch", torch.__version__)
PY
