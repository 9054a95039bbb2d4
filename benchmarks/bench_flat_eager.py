"""The eager donated step in the flat layout against the per-tensor layout (#21).

``fg.make_step(loss, chain(per_group(zero_fix), adam), donate=True)`` not compiled, on
``fg.params(model)`` (flat) and on a params dict built by hand (one tensor per
parameter), and two torch steps on the same model: the published hook answer +
``torch.optim.Adam`` (the seed rule the wrong way), and a plain step without any rule
(``loss.backward()`` + ``torch.optim.Adam(foreach=True)``). All timed side by side in
one process (``interleaved``: alternating rounds, median), so machine noise hits all
alike.

Run: python benchmarks/bench_flat_eager.py [--layers 0 200]
(0 is bench_step.py's MLP; L > 0 is L blocks of Linear(64, 64) + ReLU.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_step import interleaved, per_name
from hook_answer import attach_hook_answer
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
            # per tensor: separate tensors of the module, not views of fg.params' buffer
            params = per_name(m) if name == "per-tensor" else fg.params(m)
            state = tx.init(params)
            step = fg.make_step(loss, tx, donate=True)
            calls[name] = lambda s=step, p=params, st=state, x=x, y=y: s(p, st, x, y)
        for name in ("hook answer", "plain torch"):
            m, loss, x, y = setup(layers)
            if name == "hook answer":
                attach_hook_answer(m)
            opt = torch.optim.Adam(m.parameters(), foreach=True)

            def torch_step(m=m, opt=opt, x=x, y=y, mse=layers > 0) -> None:
                opt.zero_grad()
                out = m(x)
                loss = ((out - y) ** 2).mean() if mse else nn.functional.cross_entropy(out, y)
                loss.backward()
                opt.step()

            calls[name] = torch_step
        ms = {k: v * 1e3 for k, v in interleaved(calls, 7, 20, warmup=1).items()}
        tensors = sum(1 for _ in m.parameters())
        print(f"{layers or 'MLP'} layers ({tensors} tensors, torch {torch.__version__}):")
        for name, t in ms.items():
            ratios = ", ".join(f"{t / ms[o]:.2f}x {o}" for o in ms if o != name)
            print(f"  {name:12s} {t:7.2f} ms   ({ratios})")


if __name__ == "__main__":
    main()
