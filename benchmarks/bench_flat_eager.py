"""The eager donated step in the flat layout against the per-tensor layout (#21).

``fg.make_step(loss, chain(per_group(zero_fix), adam), donate=True)`` not compiled, on
``fg.params(model)`` (flat) and on a params dict built by hand (one tensor per
parameter), timed side by side in one process (``interleaved``: alternating rounds,
median), so machine noise hits both alike.

Run: python benchmarks/bench_flat_eager.py [--layers 0 200]
(0 is bench_step.py's MLP; L > 0 is L blocks of Linear(64, 64) + ReLU.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import interleaved
from study_flat_state import setup

import funcgrad as fg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 200])
    args = ap.parse_args()
    for layers in args.layers:
        calls = {}
        for name in ("flat", "per-tensor"):
            m, loss, x, y = setup(layers)
            tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam())
            params = fg.params(m)
            if name == "per-tensor":
                params = {k: p.detach() for k, p in m.named_parameters()}
            state = tx.init(params)
            step = fg.make_step(loss, tx, donate=True)
            calls[name] = lambda s=step, p=params, st=state, x=x, y=y: s(p, st, x, y)
        ms = {k: v * 1e3 for k, v in interleaved(calls, 7, 20, warmup=1).items()}
        tensors = sum(1 for _ in m.parameters())
        print(
            f"{layers or 'MLP'} layers ({tensors} tensors, torch {torch.__version__}): "
            f"flat {ms['flat']:.2f} ms, per-tensor {ms['per-tensor']:.2f} ms, "
            f"ratio {ms['flat'] / ms['per-tensor']:.2f}x"
        )


if __name__ == "__main__":
    main()
