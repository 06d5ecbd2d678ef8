#!/usr/bin/env bash
# The checks that need a CUDA device, as one script (how the GPU figures in the
# README were produced): the CUDA tests, the GPU benchmark, a short demo on
# CUDA, then the whole suite under the machine's own torch.
#
# Usage: bash benchmarks/run_gpu_checks.sh OUTDIR   (python3 must hold a CUDA torch)
set -u
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
  > "$out/gpu.txt" 2>&1
echo "== CUDA tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rA \
  tests/test_cuda.py tests/losses/test_no_host_sync.py > "$out/cuda_tests.txt" 2>&1
tail -5 "$out/cuda_tests.txt"
echo "== GPU benchmark"
timeout 240 python3 benchmarks/bench_gpu.py --repeats 10 > "$out/bench_gpu.txt" 2>&1
cat "$out/bench_gpu.txt"
echo "== demo on CUDA"
timeout 90 python3 -m rlmath demo --device cuda --steps 60 --no-progress \
  --out "$out/demo" > "$out/demo.txt" 2>&1
tail -4 "$out/demo.txt"
echo "== whole suite under this torch"
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests > "$out/suite.txt" 2>&1
tail -8 "$out/suite.txt"
