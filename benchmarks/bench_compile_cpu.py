"""Cold compile cost in CPU seconds: the gradients alone against funcgrad's steps (#21).

Each variant's first call runs in a fresh process with an empty inductor cache, the
FX graph and AOTAutograd caches off, and ``TORCHINDUCTOR_COMPILE_THREADS=1`` (gcc runs
as a waited-for child, so its time is counted). What is reported is the CPU time of
that process and its children during the first call, not wall time: on a shared
2-core machine wall-clock cold compiles scattered by +-3 s between identical runs,
CPU seconds by about +-1 s.

Variants, on ``common.problem``'s models (``--layers 0`` is the MLP
256-512-512-512-10, ``N`` is N x ``Linear(64, 64)`` + ReLU):

- ``grad``: ``torch.compile(grad_and_value(loss))`` over one tensor per parameter
- ``adam``: ``make_step(loss, fg.adam(), compile=True, donate=True)`` on ``fg.params``
- ``step``: the same with the seed rule per layer before Adam
- ``step-dict``: ``step`` on a params dict built by hand (the per-tensor layout)
- ``step-p1``: ``step`` with ``funcgrad.rules._per_group.MAX_PERIOD = 1``: only runs of
  adjacent equal groups ruled together, not blocks of several groups that repeat

``--model gpt``: examples/char_gpt.py's transformer instead (``--layers N``: N blocks,
dim 64, 4 heads, 64 tokens x 8, tied embeddings), grouped per module (each block's
``ln1``, ``qkv``, ``proj``, ``ln2``, ``mlp.0``, ``mlp.2``: six groups that repeat).

Run: python benchmarks/bench_compile_cpu.py [--layers 0 10 40] [--rounds 2]
     python benchmarks/bench_compile_cpu.py --model gpt --layers 8 --variants grad step step-p1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS,
    cold_caches,
    cpu_seconds,
    gpt_ce,
    gpt_problem,
    per_name,
    problem,
    run_json,
)

VARIANTS = ("grad", "adam", "step", "step-dict", "step-p1")


def make_call(layers: int, variant: str) -> Callable[[], object]:
    """One step of ``variant`` on ``common.problem(layers)``, not yet called."""
    from torch.func import grad_and_value

    import funcgrad as fg

    m, loss, x, y = problem(layers)
    if variant == "grad":  # the model's own gradients, one tensor per parameter
        f = torch.compile(grad_and_value(loss), fullgraph=True)
        plain = per_name(m)
        return lambda: f(plain, x, y)
    tx: fg.GradientTransformation = fg.adam()
    if variant != "adam":
        tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), tx)
    params = per_name(m) if variant == "step-dict" else fg.params(m)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=True, donate=True)
    return lambda: step(params, state, x, y)


def gpt_call(layers: int, variant: str) -> Callable[[], object]:
    """One step of ``variant`` on examples/char_gpt.py's model, not yet called."""
    from torch.func import grad_and_value

    import funcgrad as fg

    m, x, y = gpt_problem(64, layers, batch=8)

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt_ce(fg.call(m, p, x), y)

    if variant == "grad":
        f = torch.compile(grad_and_value(loss), fullgraph=True)
        plain = per_name(m)
        return lambda: f(plain, x, y)
    tx = fg.adamw(lr=1e-3)
    if variant != "adam":
        tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), tx)
    params = fg.params(m) if variant != "step-dict" else per_name(m)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=True, donate=True)
    return lambda: step(params, state, x, y)


def child(layers: int, variant: str, model: str) -> dict[str, float]:
    """The first call's CPU and wall seconds, in this (fresh) process."""
    if variant == "step-p1":
        import funcgrad.rules._per_group

        funcgrad.rules._per_group.MAX_PERIOD = 1
    base = "step" if variant == "step-p1" else variant
    call = make_call(layers, base) if model == "mlp" else gpt_call(layers, base)
    c, t = cpu_seconds(), time.perf_counter()
    call()
    return {"cpu_s": cpu_seconds() - c, "wall_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 10, 40])
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; min kept")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.child[2])))
        return
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for layers in args.layers:
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for variant in args.variants:
                with tempfile.TemporaryDirectory() as cache:
                    one_thread = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
                    argv = [__file__, "--child", str(layers), variant, args.model]
                    runs[variant].append(run_json(argv, {**cold_caches(cache), **one_thread}))
        name = "MLP 256-512-512-512-10" if layers == 0 else f"{layers} x Linear(64, 64)"
        if args.model == "gpt":
            name = f"char_gpt.py's transformer, {layers} blocks, grouped per module"
        base = min(r["cpu_s"] for r in runs[args.variants[0]])
        print(f"\n{name}: first call, CPU seconds per round (ratio of the minima to "
              f"{args.variants[0]!r})")  # fmt: skip
        for variant, rs in runs.items():
            cpu = [r["cpu_s"] for r in rs]
            shown = " / ".join(f"{c:.1f}" for c in cpu)
            print(f"  {variant:10s} {shown:>20s} s   {min(cpu) / base:.2f}x", flush=True)
        results[name] = runs
    args.out.mkdir(exist_ok=True)
    (args.out / "bench_compile_cpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
