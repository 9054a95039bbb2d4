"""The compiled step on the flat layout against the per-tensor layout, side by side (#21).

Both steps are ``fg.make_step(loss, tx, compile=True, donate=True)`` on the same MLP
(256-512-512-512-10, batch 64): ``flat`` on ``fg.params(model)`` (one buffer, since
#21), ``dict`` on a params dict built by hand (one tensor per parameter, as before
#21). Two transformations: Adam alone, and the seed rule per layer + Adam. Printed per
pair: ms per step (timed round-robin, median) and the time spent inside the generated
kernels of the compiled graph (the profiler's self time of ``CompiledFxGraph``, which
excludes the matrix products), and the flat / dict ratios.

``--device cuda`` (``benchmarks/gpu.sh`` runs it) times on the GPU (synchronized) and
counts the kernels launched per step (``torch.profiler`` CUDA events: inductor's
generated kernels and the matrix products), the other figure the flat layout should
cut. On the CPU the count is of ATen calls made outside the generated C++ code
(matrix products and other extern kernels), which the profiler sees one by one.

Run: python benchmarks/bench_flat_compiled.py [--repeats 9] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fg-bench-flat-"))

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import interleaved, mlp, per_name


def build(flat: bool, rule: bool, device: str = "cpu") -> tuple[Callable[[], object], float]:
    """The compiled donated step and its first call's seconds (compile included)."""
    torch.manual_seed(0)
    m = mlp().to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(m, p, x), y)

    adam = fg.adam()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), adam) if rule else adam
    params = fg.params(m) if flat else per_name(m)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=True, donate=True)
    t = time.perf_counter()
    step(params, state, x, y)
    _sync(device)
    return (lambda: step(params, state, x, y)), time.perf_counter() - t


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_ms(f: Callable[[], object], calls: int = 20) -> float:
    """ms per call inside the compiled graph's generated kernels (CPU)."""
    with profile() as prof:
        for _ in range(calls):
            f()
    own = [e for e in prof.key_averages() if e.key.startswith("## Call CompiledFxGraph")]
    return sum(e.self_cpu_time_total for e in own) / calls / 1e3


def launches(f: Callable[[], object], device: str, calls: int = 20) -> float:
    """Kernels launched per call: CUDA kernel events on the GPU; on the CPU, the ATen
    calls the profiler records (extern kernels; inductor's C++ code is one call)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            f()
        _sync(device)
    if device == "cuda":
        n = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    else:
        n = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return n / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    where = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {where or ''}")
    for rule in (False, True):
        name = "seed rule + adam" if rule else "adam"
        fns, firsts = {}, {}
        for layout in ("flat", "dict"):
            fns[layout], firsts[layout] = build(layout == "flat", rule, args.device)
        steps = interleaved(fns, args.repeats, 30, sync=lambda: _sync(args.device))
        ms = {k: v * 1e3 for k, v in steps.items()}
        count = {k: launches(f, args.device) for k, f in fns.items()}
        what = "kernel launches" if args.device == "cuda" else "ATen calls"
        print(
            f"{name:17s} step  flat {ms['flat']:6.2f} ms  dict {ms['dict']:6.2f} ms"
            f"  ratio {steps['flat'] / steps['dict']:.2f}\n"
            f"{'':17s} {what} per step  flat {count['flat']:.0f}  dict {count['dict']:.0f}"
        )
        if args.device == "cpu":
            kernels = {k: kernel_ms(f) for k, f in fns.items()}
            print(
                f"{'':17s} kernels flat {kernels['flat']:5.2f} ms  dict {kernels['dict']:5.2f} ms"
                f"  ratio {kernels['flat'] / kernels['dict']:.2f}"
            )
        print(f"{'':17s} first call flat {firsts['flat']:.1f} s  dict {firsts['dict']:.1f} s")


if __name__ == "__main__":
    main()
