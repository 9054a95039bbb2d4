#!/usr/bin/env bash
# GPU checks (issue #13, target 8), for a machine with a CUDA device.
#
# Uses that machine's own Python and torch (a CUDA build; nothing is downloaded):
#     PYTHON=python3 bash benchmarks/gpu.sh
# Needs torch (CUDA), optree, pytest and numpy importable by $PYTHON; funcgrad is
# taken from this checkout (PYTHONPATH). Writes its outputs to $OUT
# (default benchmarks/results): gpu_tests.txt, gpu_scaling.txt and its JSON, gpu_flat.txt,
# gpu_async.txt.
#
# 1. tests/test_device.py with FUNCGRAD_TEST_DEVICE=cuda: Adam against torch.optim in
#    float32/float16/bfloat16, the compiled (inductor) donated step and
#    compile="gradients" against the eager one (one graph), vmap per-sample rules against a loop, hooks.attach against the
#    functional rule, a state round trip: every reference computed on the GPU.
# 2. benchmarks/bench_scaling.py --device cuda: eager step against the hook answer +
#    torch.optim, cold compile and step (compile=True and compile="gradients") against
#    the gradient computation alone, for 10/100/1000 small layers (compiles for 10 and
#    40).
# 3. benchmarks/bench_flat_compiled.py --device cuda: the compiled MLP step on the flat
#    layout (fg.params) against the per-tensor one (a dict built by hand), interleaved,
#    and the CUDA kernels each launches per step (torch.profiler) (#21).
# 4. benchmarks/bench_async.py --device cuda: compile="async" against compile=True and
#    the eager step, each in a fresh process with a cold inductor cache: time to the
#    first step, the switch and the end of 1000 steps (#41).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, optree, pytest
assert torch.cuda.is_available(), "benchmarks/gpu.sh: no CUDA device visible to torch"
print("torch", torch.__version__, "on", torch.cuda.get_device_name())'
FUNCGRAD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_device.py \
    2>&1 | tee "$OUT/gpu_tests.txt"
"$PY" benchmarks/bench_scaling.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/gpu_scaling.txt"
"$PY" benchmarks/bench_flat_compiled.py --device cuda 2>&1 | tee "$OUT/gpu_flat.txt"
"$PY" benchmarks/bench_async.py --device cuda 2>&1 | tee "$OUT/gpu_async.txt"
