"""Updates under torch.func: a vmapped ensemble step, and a MAML outer step.

1. Ensemble: ``--models`` MLPs 64-128-10 (digits-sized) trained by one step that is
   ``vmap`` of grad + the seed rule + AdamW + the update (eager, and compiled),
   against a Python loop of ``fg.make_step`` (eager, donated) over the models.
2. MAML outer step (sine regression, 8 tasks vmapped, 3 inner Adam steps, second
   order): the inner Adam as ``fg.adam``, as the same Adam written by hand in torch
   ops, and as TorchOpt's functional ``torchopt.adam`` (``inplace=False``, its
   differentiable mode) if TorchOpt is installed (``pip install -e ".[bench]"``).

All variants are checked equal before timing. Timed side by side, interleaved,
median of repeats; the ratios are what counts.

Run: python benchmarks/bench_compose.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from common import RESULTS, interleaved
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import funcgrad as fg


def ensemble(n_models: int, repeats: int, number: int) -> dict[str, float]:
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)) for _ in range(n_models)
    ]
    base = copy.deepcopy(models[0]).to("meta")

    def loss(p, x, t):
        return nn.functional.cross_entropy(functional_call(base, p, (x,)), t)

    tx = fg.chain(
        fg.per_group(fg.rules.zero_fix(), fg.group_by_module(models[0])),
        fg.adamw(lr=1e-2, weight_decay=1e-3),
    )
    xs, ts = torch.randn(n_models, 64, 64), torch.randint(0, 10, (n_models, 64))

    def one(p, s, x, t):
        u, s = tx.update(grad(loss)(p, x, t), s, p)
        return fg.apply_updates(p, u), s

    vstep = vmap(one)
    cstep = torch.compile(vmap(one), fullgraph=True)
    # One step per model, as a user with 8 models would keep: a donated step re-runs
    # its checks whenever it is handed other tensors than on its last call.
    model_steps = [fg.make_step(loss, tx, donate=True) for _ in models]

    stacked = {k: v.detach().clone() for k, v in stack_module_state(models)[0].items()}
    state = vmap(tx.init)(stacked)
    singles = [fg.params(copy.deepcopy(m)) for m in models]
    single_states = [tx.init(p) for p in singles]

    # Same answer from all three on one step before timing.
    a = vstep(stacked, state, xs, ts)[0]
    b = cstep(stacked, state, xs, ts)[0]
    for m in range(n_models):
        p = {k: v.clone() for k, v in singles[m].items()}
        ref = fg.make_step(loss, tx)(p, tx.init(p), xs[m], ts[m])[0]
        for k in ref:
            torch.testing.assert_close(a[k][m], ref[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b[k][m], ref[k], rtol=1e-5, atol=1e-6)

    def loop() -> None:
        for m in range(n_models):
            model_steps[m](singles[m], single_states[m], xs[m], ts[m])

    return interleaved(
        {
            "loop of make_step": loop,
            "vmap eager": lambda: vstep(stacked, state, xs, ts),
            "vmap compiled": lambda: cstep(stacked, state, xs, ts),
        },
        repeats,
        number,
    )


def maml(repeats: int, number: int) -> dict[str, float]:
    torch.manual_seed(0)
    h, inner_steps, lr, n_tasks, shots = 40, 3, 0.05, 8, 10

    def init() -> dict[str, torch.Tensor]:
        sizes = [(h, 1), (h,), (h, h), (h,), (1, h), (1,)]
        names = ["l1.w", "l1.b", "l2.w", "l2.b", "l3.w", "l3.b"]
        return {
            n: torch.randn(s) * (1 / math.sqrt(s[-1])) for n, s in zip(names, sizes, strict=True)
        }

    def mse(p, x, y):
        x = torch.relu(x @ p["l1.w"].T + p["l1.b"])
        x = torch.relu(x @ p["l2.w"].T + p["l2.b"])
        return ((x @ p["l3.w"].T + p["l3.b"] - y) ** 2).mean()

    fg_tx = fg.adam(lr=lr, eps_root=1e-12)

    def adapt_fg(p, x, y):
        s = fg_tx.init(p)
        for _ in range(inner_steps):
            u, s = fg_tx.update(grad(mse)(p, x, y), s, p)
            p = fg.apply_updates(p, u)
        return p

    def adapt_hand(p, x, y, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12):
        m = {k: torch.zeros_like(v) for k, v in p.items()}
        v = {k: torch.zeros_like(t) for k, t in p.items()}
        for t in range(1, inner_steps + 1):
            g = grad(mse)(p, x, y)
            m = {k: b1 * m[k] + (1 - b1) * g[k] for k in p}
            v = {k: b2 * v[k] + (1 - b2) * g[k] * g[k] for k in p}
            p = {
                k: p[k]
                - lr * (m[k] / (1 - b1**t)) / (torch.sqrt(v[k] / (1 - b2**t) + eps_root) + eps)
                for k in p
            }
        return p

    adapters = {"fg.adam": adapt_fg, "hand-written Adam": adapt_hand}
    try:
        import torchopt

        to_tx = torchopt.adam(lr=lr, eps_root=1e-12)

        def adapt_torchopt(p, x, y):
            s = to_tx.init(p)
            for _ in range(inner_steps):
                u, s = to_tx.update(grad(mse)(p, x, y), s, params=p, inplace=False)
                p = torchopt.apply_updates(p, u, inplace=False)
            return p

        adapters["torchopt.adam"] = adapt_torchopt
    except ImportError:
        print("  (TorchOpt not installed: pip install -e '.[bench]' to time it)")

    outer = fg.adam(lr=1e-3)
    xs, ys = torch.rand(n_tasks, shots, 1) * 10 - 5, torch.randn(n_tasks, shots, 1)
    xq, yq = torch.rand(n_tasks, shots, 1) * 10 - 5, torch.randn(n_tasks, shots, 1)

    def outer_step(adapt, batched: bool = True):
        def meta_loss(p):
            if not batched:  # a Python loop over the tasks
                tasks = zip(xs, ys, xq, yq, strict=True)
                return sum(mse(adapt(p, a, b), c, d) for a, b, c, d in tasks) / n_tasks
            per_task = vmap(lambda a, b, c, d: mse(adapt(p, a, b), c, d))
            return per_task(xs, ys, xq, yq).mean()

        def run(p, s):
            u, s = outer.update(grad(meta_loss)(p), s, p)
            return fg.apply_updates(p, u), s

        return run

    p0 = init()
    s0 = outer.init(p0)
    steps = {name: outer_step(a) for name, a in adapters.items()}
    if "torchopt.adam" in steps:
        try:
            steps["torchopt.adam"](p0, s0)
        except RuntimeError as err:  # its in-place moment update under vmap
            print(f"  torchopt.adam under vmap fails ({str(err).splitlines()[0]}): timed with")
            print("  a Python loop over the tasks instead, beside fg.adam in the same loop")
            del steps["torchopt.adam"]
            steps["torchopt.adam, task loop"] = outer_step(adapters["torchopt.adam"], False)
            steps["fg.adam, task loop"] = outer_step(adapt_fg, batched=False)
    ref = steps["hand-written Adam"](p0, s0)[0]
    for name, fn in steps.items():
        got = fn(p0, s0)[0]
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=name)
    return interleaved(
        {name: (lambda fn=fn: fn(p0, s0)) for name, fn in steps.items()}, repeats, number
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    repeats, number = (3, 2) if args.quick else (7, 5)
    torch.set_num_threads(torch.get_num_threads())

    t = ensemble(args.models, repeats, number)
    base = t["loop of make_step"]
    print(f"ensemble of {args.models} MLPs 64-128-10, batch 64, seed rule + AdamW, one step")
    for k, v in t.items():
        print(f"  {k:26s} {v * 1e3:8.2f} ms   {v / base:5.2f}x the loop")
    m = maml(repeats, max(1, number // 2))
    ref = m["hand-written Adam"]
    print("MAML outer step, 8 sine tasks vmapped, 3 inner Adam steps, second order")
    for k, v in m.items():
        print(f"  {k:26s} {v * 1e3:8.2f} ms   {v / ref:5.2f}x the hand-written Adam")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_compose.json"
    path.write_text(json.dumps({"ensemble_seconds": t, "maml_seconds": m}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
