#!/usr/bin/env bash
# The checks that need a CUDA device, as one script (how the GPU figures in the
# README are produced): the CUDA tests (the pure-torch and the Triton backends),
# the GPU benchmark with its peers, a short demo on CUDA, then the whole suite
# under the machine's own torch.
#
# Usage: [WHEELS=DIR] [STEPS=tests,bench,demo,suite] [BENCH_ARGS=...] \
#          bash benchmarks/run_gpu_checks.sh OUTDIR
#   python3 must hold a CUDA torch. The GPU machine has no network: packages it
#   lacks (triton, liger-kernel) are installed from the wheels in WHEELS (default
#   ./wheels if present; fill it with `pip download --no-deps liger-kernel triton
#   -d wheels/`) into OUTDIR/pydeps, never into the machine's Python. STEPS picks
#   the steps to run (all by default); BENCH_ARGS go to bench_gpu.py (e.g.
#   "--areas fused --repeats 5").
set -u
out=${1:-gpu-checks}
wheels=${WHEELS:-wheels}
steps=",${STEPS:-tests,bench,demo,suite},"
want() { case "$steps" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/$out/pydeps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
  > "$out/gpu.txt" 2>&1
echo "== packages"
for pkg in triton:triton liger_kernel:liger-kernel; do
  mod=${pkg%%:*} dist=${pkg##*:}
  if python3 -c "import $mod" 2>/dev/null; then
    echo "$dist: already importable"
  elif [ -d "$wheels" ]; then
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --find-links "$wheels" \
      --target "$out/pydeps" "$dist" && echo "$dist: installed from $wheels" \
      || echo "$dist: not installed (no matching wheel in $wheels)"
  else
    echo "$dist: not importable and no wheel folder ($wheels)"
  fi
done 2>&1 | tee "$out/packages.txt"
python3 -c "import triton; print('triton', triton.__version__)" >> "$out/gpu.txt" 2>&1
if want tests; then
  echo "== CUDA tests"
  timeout 600 python3 -m pytest -q -p no:cacheprovider -rA \
    tests/test_cuda.py tests/losses/test_no_host_sync.py > "$out/cuda_tests.txt" 2>&1
  tail -5 "$out/cuda_tests.txt"
fi
if want bench; then
  echo "== GPU benchmark"
  # shellcheck disable=SC2086
  timeout 1500 python3 benchmarks/bench_gpu.py ${BENCH_ARGS:---repeats 10} > "$out/bench_gpu.txt" 2>&1
  cat "$out/bench_gpu.txt"
fi
if want demo; then
  echo "== demo on CUDA"
  timeout 90 python3 -m rlmath demo --device cuda --steps 60 --no-progress \
    --out "$out/demo" > "$out/demo.txt" 2>&1
  tail -4 "$out/demo.txt"
fi
if want suite; then
  echo "== whole suite under this torch"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests > "$out/suite.txt" 2>&1
  tail -8 "$out/suite.txt"
fi
