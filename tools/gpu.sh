#!/usr/bin/env bash
# GPU checks (issue #13, target 8), for a machine with a CUDA device.
#
# Uses that machine's own Python and torch (a CUDA build; nothing is downloaded):
#     PYTHON=python3 bash tools/gpu.sh
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
# 3. benchmarks/bench_step.py --part layout-compiled --device cuda: the compiled MLP step on the flat
#    layout (fg.params) against the per-tensor one (a dict built by hand), interleaved,
#    and the CUDA kernels each launches per step (torch.profiler) (#21).
# 4. benchmarks/bench_async.py --device cuda: compile="async" against compile=True and
#    the eager step, each in a fresh process with a cold inductor cache: time to the
#    first step, the switch and the end of 1000 steps (#41).
# 5. benchmarks/bench_drop_in.py --device cuda: fg.Optimizer's eager step on CUDA's
#    fused kernels against torch.optim.AdamW(fused=True), foreach, the compiled arms and
#    HeavyBall where installed, three workloads (#52): gpu_drop_in.txt.
#
# Each check has its own time limit (seconds, scaled by GPU_TIME_SCALE, default 1) and
# a failed or timed-out check does not stop the next: a device lent for 15 minutes
# brings back what ran. The exit status is 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
SCALE=${GPU_TIME_SCALE:-1}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, optree, pytest
assert torch.cuda.is_available(), "tools/gpu.sh: no CUDA device visible to torch"
print("torch", torch.__version__, "on", torch.cuda.get_device_name())' || exit 1
failed=0
check() {  # check NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    limit=$(awk -v a="$limit" -v b="$SCALE" 'BEGIN { print int(a * b) }')
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
    [ "$rc" = 0 ] || failed=1
}
check gpu_tests 110 env FUNCGRAD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_device.py
check gpu_async 150 "$PY" benchmarks/bench_async.py --device cuda
check gpu_drop_in 200 "$PY" benchmarks/bench_drop_in.py --device cuda --out "$OUT"
check gpu_flat 60 "$PY" benchmarks/bench_step.py --part layout-compiled --device cuda \
    --out "$OUT"
check gpu_scaling 110 "$PY" benchmarks/bench_scaling.py --device cuda --out "$OUT" \
    --layers 10 100 1000 --compile-layers 10 40
exit $failed
