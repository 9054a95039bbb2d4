"""The compiled step on the flat layout against the per-tensor layout, side by side (#21).

Both steps are ``fg.make_step(loss, tx, compile=True, donate=True)`` on the same MLP
(256-512-512-512-10, batch 64): ``flat`` on ``fg.params(model)`` (one buffer, since
#21), ``dict`` on a params dict built by hand (one tensor per parameter, as before
#21). Two transformations: Adam alone, and the seed rule per layer + Adam. Printed per
pair: ms per step (timed round-robin, median) and the time spent inside the generated
kernels of the compiled graph (the profiler's self time of ``CompiledFxGraph``, which
excludes the matrix products), and the flat / dict ratios.

Run: python benchmarks/bench_flat_compiled.py [--repeats 9]
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
from torch.profiler import profile

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import interleaved, mlp


def build(flat: bool, rule: bool) -> tuple[Callable[[], object], float]:
    """The compiled donated step and its first call's seconds (compile included)."""
    torch.manual_seed(0)
    m = mlp()
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(m, p, x), y)

    adam = fg.adam()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), adam) if rule else adam
    params = fg.params(m) if flat else {k: p.detach().clone() for k, p in m.named_parameters()}
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=True, donate=True)
    t = time.perf_counter()
    step(params, state, x, y)
    return (lambda: step(params, state, x, y)), time.perf_counter() - t


def kernel_ms(f: Callable[[], object], calls: int = 20) -> float:
    """ms per call inside the compiled graph's generated kernels."""
    with profile() as prof:
        for _ in range(calls):
            f()
    own = [e for e in prof.key_averages() if e.key.startswith("## Call CompiledFxGraph")]
    return sum(e.self_cpu_time_total for e in own) / calls / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.processor() or ''}")
    for rule in (False, True):
        name = "seed rule + adam" if rule else "adam"
        fns, firsts = {}, {}
        for layout in ("flat", "dict"):
            fns[layout], firsts[layout] = build(layout == "flat", rule)
        steps = interleaved(fns, args.repeats, 30)
        kernels = {k: kernel_ms(f) for k, f in fns.items()}
        ms = {k: v * 1e3 for k, v in steps.items()}
        print(
            f"{name:17s} step  flat {ms['flat']:6.2f} ms  dict {ms['dict']:6.2f} ms"
            f"  ratio {steps['flat'] / steps['dict']:.2f}\n"
            f"{'':17s} kernels flat {kernels['flat']:5.2f} ms  dict {kernels['dict']:5.2f} ms"
            f"  ratio {kernels['flat'] / kernels['dict']:.2f}\n"
            f"{'':17s} first call flat {firsts['flat']:.1f} s  dict {firsts['dict']:.1f} s"
        )


if __name__ == "__main__":
    main()
