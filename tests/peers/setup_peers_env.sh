#!/usr/bin/env bash
# Build a peers environment, every version pinned in tests/peers/constraints.txt:
#   PEERS=peers (default): .venv-peers, torch 2.13.0 (CPU) + verl 0.9.1 + TRL 0.24.0 + rlmath
#     (editable), with only the packages that `import verl.utils.torch_functional`,
#     `import verl.trainer.ppo.core_algos` and TRL's GRPOTrainer need;
#   PEERS=trl-new: .venv-peers-trl-new, the same torch + the newest TRL tested (no verl).
# Never committed (.gitignore has `.venv-*/`). Usage, from the repository root:
#   bash tests/peers/setup_peers_env.sh            # or VENV=/some/path bash ...
#   PEERS=trl-new bash tests/peers/setup_peers_env.sh
#   .venv-peers/bin/python -m pytest -q tests/peers
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS:-peers}"
case "$PEERS" in
  peers) DROP="# trl-new" ;;
  trl-new) DROP="# peers" ;;
  *) echo "PEERS must be 'peers' or 'trl-new', got '$PEERS'" >&2; exit 2 ;;
esac
if [ "$PEERS" = peers ]; then DEFAULT_VENV="$ROOT/.venv-peers"; else DEFAULT_VENV="$ROOT/.venv-peers-trl-new"; fi
VENV="${VENV:-$DEFAULT_VENV}"
PY="$VENV/bin/python"

test -x "$PY" || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip

# 1. The constraints of this environment (every pin applies to every later step, so no
#    step can replace torch: a bare `torch` requirement would pull the multi-GB CUDA build).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
grep -v -- "$DROP" "$ROOT/tests/peers/constraints.txt" | sed 's/[[:space:]]*#.*$//' | grep . >"$CONSTRAINTS"
PIP=("$PY" -m pip install -q -c "$CONSTRAINTS")
"${PIP[@]}" torch

if [ "$PEERS" = peers ]; then
  # 2. verl without its (huge) dependency list, then what its math modules import:
  #    verl/__init__ -> verl.protocol -> ray, tensordict, numpy, packaging;
  #    torch_functional -> transformers; core_algos -> omegaconf; verl.utils -> codetiming;
  #    and what its trainer and workers import (test_compat_verl_workers.py:
  #    ray_trainer.compute_advantage, the FSDP engine's actor and critic on CPU).
  "${PIP[@]}" --no-deps verl
  "${PIP[@]}" packaging numpy ray tensordict transformers omegaconf codetiming \
    torchdata tqdm uvicorn fastapi dill peft pillow cachetools
fi

# 3. TRL without deps; trl.trainer.utils imports accelerate and pandas, and
#    trl.trainer.grpo_trainer imports datasets (and, through transformers, tokenizers).
"${PIP[@]}" --no-deps trl
"${PIP[@]}" transformers tokenizers accelerate pandas datasets

# 4. rlmath itself (editable) and the test tools; `parameterized` is what TRL's own tests
#    (copied in tests/peers/trl_0_24_0/) use.
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" pytest hypothesis numpy parameterized

# 5. Check: torch is still the pinned CPU build and every peer imports.
PEERS="$PEERS" "$PY" - <<'PY'
import os

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
import trl.trainer.utils  # noqa: F401

if os.environ["PEERS"] == "peers":
    # (TRL 0.24's trainer modules need a transformers-5 shim to import: the tests apply it.)
    import verl.trainer.ppo.core_algos  # noqa: F401
    import verl.trainer.ppo.ray_trainer  # noqa: F401
    import verl.utils.torch_functional  # noqa: F401
    import verl.workers.engine_workers  # noqa: F401
else:
    import trl.trainer.grpo_trainer  # noqa: F401

import rlmath  # noqa: F401

print("peers env ready: torch", torch.__version__, "trl", trl.__version__)
PY
