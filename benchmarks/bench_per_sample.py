"""Per-sample gradients + a per-sample rule: vmap (eager, compiled) vs a Python loop.

MLP 256-512-512-512-10, batch 64, the zero rule per layer on every sample's
gradients, then the mean. Timed side by side, interleaved, median of repeats; the
ratios are what counts. Target: vmap at least 10x faster than the loop.

Run: python benchmarks/bench_per_sample.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_step import interleaved, mlp
from torch import nn

import funcgrad as fg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
    params = fg.params(model)
    groups = fg.group_by_module(model)
    rule = fg.per_group(fg.rules.zero_fix(), groups)

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    psg = fg.per_sample_grads(loss_fn)

    def vmapped(p, x, y):
        g = psg(p, x, y)
        fixed = torch.func.vmap(lambda gi: rule.update(gi, fg.EmptyState())[0])(g)
        return {k: v.mean(0) for k, v in fixed.items()}

    compiled = torch.compile(vmapped, fullgraph=True)
    grad_fn = torch.func.grad(loss_fn)

    def loop(p, x, y):
        acc = None
        for i in range(x.shape[0]):
            g = grad_fn(p, x[i : i + 1], y[i : i + 1])
            g = rule.update(g, fg.EmptyState())[0]
            acc = g if acc is None else {k: acc[k] + g[k] for k in g}
        return {k: v / x.shape[0] for k, v in acc.items()}

    # Same answer from all three before timing anything.
    ref = loop(params, x, y)
    for fn in (vmapped, compiled):
        out = fn(params, x, y)
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-6)

    repeats, number = (3, 2) if args.quick else (7, 5)
    t = interleaved(
        {
            "python loop": lambda: loop(params, x, y),
            "vmap eager": lambda: vmapped(params, x, y),
            "vmap compiled": lambda: compiled(params, x, y),
        },
        repeats,
        number,
    )
    print(f"per-sample grads + per-sample zero rule, MLP, batch {args.batch}")
    for k, v in t.items():
        print(f"  {k:14s} {v * 1e3:8.2f} ms   {t['python loop'] / v:6.1f}x faster than the loop")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_per_sample.json").write_text(json.dumps({"seconds": t}, indent=2))
    print(f"wrote {args.out / 'bench_per_sample.json'}")


if __name__ == "__main__":
    main()
