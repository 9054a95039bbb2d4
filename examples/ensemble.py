"""An ensemble of small models trained in one vmapped funcgrad step, on digits.

functorch's ensembling recipe (``torch.func.stack_module_state`` + ``vmap``) applied
to a whole training step: gradients, the seed rule per layer, AdamW and the update,
for ``--models`` models at once, each on its own bootstrap sample of scikit-learn's
digits (no download). The same training is run as a Python loop of
``fg.make_step`` over the models (the eager fast path); the script checks that both
give the same parameters and prints the steps/s of each, and the test accuracy of
the ensemble (averaged logits) against its members.

Run: ``python examples/ensemble.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from _cli import ShowDefaults, summary


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="a vmapped ensemble training step with funcgrad",
        formatter_class=ShowDefaults,
    )
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the vmapped step")
    args = ap.parse_args(argv)
    if min(args.models, args.batch, args.hidden) < 1 or args.steps < 0:
        ap.error("--models, --batch and --hidden must be >= 1, --steps >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)  # --help answers before torch is imported

    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.func import functional_call, grad, stack_module_state, vmap

    import funcgrad as fg

    torch.manual_seed(args.seed)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=args.seed, stratify=y)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))

    models = [make() for _ in range(args.models)]
    base = copy.deepcopy(models[0]).to("meta")  # the architecture, no data

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(base, p, (x,)), t)

    groups = fg.group_by_module(models[0])
    tx = fg.chain(
        fg.per_group(fg.rules.zero_fix(), groups),
        fg.adamw(lr=args.lr, weight_decay=1e-3, mask=lambda name, p: p.ndim > 1),
    )

    # Each model trains on its own bootstrap sample: batches indexed [model, batch].
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(len(Xtr), (args.steps, args.models, args.batch), generator=gen)

    # One step for all models: vmap over the stacked parameters, states and batches.
    def one_step(p, s, x, t):
        u, s = tx.update(grad(loss)(p, x, t), s, p)
        return fg.apply_updates(p, u), s

    ensemble_step = vmap(one_step)
    if args.compile:
        ensemble_step = torch.compile(ensemble_step, fullgraph=True)

    stacked = {k: v.detach().clone() for k, v in stack_module_state(models)[0].items()}
    state = vmap(tx.init)(stacked)
    t0 = time.perf_counter()
    first = 0.0
    for i in range(args.steps):
        stacked, state = ensemble_step(stacked, state, Xtr[idx[i]], ytr[idx[i]])
        if i == 0:
            first = time.perf_counter() - t0
    vmapped_s = time.perf_counter() - t0

    # The same training, one model at a time, with the eager donated make_step.
    step = fg.make_step(loss, tx, donate=True)
    singles = []
    t0 = time.perf_counter()
    for m, model in enumerate(models):
        p = fg.params(model)
        s = tx.init(p)
        for i in range(args.steps):
            p, s, _ = step(p, s, Xtr[idx[i, m]], ytr[idx[i, m]])
        singles.append(p)
    loop_s = time.perf_counter() - t0

    diff = max(
        float((stacked[k][m] - singles[m][k]).abs().max())
        for m in range(args.models)
        for k in stacked
    )
    with torch.no_grad():
        logits = vmap(lambda p: functional_call(base, p, (Xte,)))(stacked)
    member_acc = (logits.argmax(-1) == yte).float().mean(-1)
    ens_acc = float((logits.mean(0).argmax(-1) == yte).float().mean())
    steps = args.steps * args.models
    result = {
        "max_param_diff": diff,
        "vmapped_model_steps_per_s": steps / vmapped_s if vmapped_s else float("nan"),
        "loop_model_steps_per_s": steps / loop_s if loop_s else float("nan"),
        "first_step_s": first,
        "member_acc_mean": float(member_acc.mean()),
        "ensemble_acc": ens_acc,
    }
    how = "compiled" if args.compile else "eager"
    print(
        f"{args.models} models x {args.steps} steps: vmapped step ({how}) "
        f"{result['vmapped_model_steps_per_s']:.0f} model-steps/s (first call {first:.1f} s), "
        f"loop of fg.make_step {result['loop_model_steps_per_s']:.0f} model-steps/s"
    )
    print(f"largest parameter difference between the two: {diff:.2e}")
    print(
        f"test accuracy: members {float(member_acc.min()):.3f}-{float(member_acc.max()):.3f} "
        f"(mean {result['member_acc_mean']:.3f}), ensemble {ens_acc:.3f}"
    )
    summary(
        "ensemble",
        models=args.models,
        max_param_diff=diff,
        member_acc_mean=result["member_acc_mean"],
        ensemble_acc=ens_acc,
        vmapped_over_loop_speed=result["vmapped_model_steps_per_s"]
        / result["loop_model_steps_per_s"],
    )
    return result


if __name__ == "__main__":
    main()
