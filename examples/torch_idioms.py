"""The torch.optim idioms, unchanged, with fg.Optimizer: one script, two optimizers.

A fine-tuning script as people write it for torch.optim, run twice on scikit-learn's
digits: once with ``torch.optim.AdamW``, once with ``fg.Optimizer`` over ``fg.adamw``
(the only line that differs). It uses:

- ``model.parameters()``-style param groups: weight decay on weights, none on biases
  (the decay/no-decay split Hugging Face Trainer builds);
- ``OneCycleLR`` with its default ``cycle_momentum=True``, which writes ``betas`` into
  every group each step;
- progressive unfreezing: the backbone starts frozen (``requires_grad=False``, left out
  of the optimizer) and joins mid-training with ``add_param_group`` at a lower lr,
  then a cosine schedule over all groups;
- a hand-written weight-decay change (``group["weight_decay"] = ...``) for the last
  epoch.

Prints each phase's loss for both runs, the test accuracy, and the largest difference
between the two runs' parameters (float64: the same arithmetic, to rounding).

Run: ``python examples/torch_idioms.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-epochs", type=int, default=3, help="head only (default 3)")
    ap.add_argument("--all-epochs", type=int, default=4, help="after unfreezing (default 4)")
    ap.add_argument("--lr", type=float, default=3e-2, help="the head's peak lr (default 3e-2)")
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = ap.parse_args(argv)
    if args.head_epochs < 1 or args.all_epochs < 1:
        ap.error("--head-epochs and --all-epochs must be >= 1")

    import torch  # after argparse: --help answers at once
    from sklearn.datasets import load_digits
    from torch import nn

    import funcgrad as fg

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float64) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    train, test = perm[:1400], perm[1400:]
    batches = train.split(100)

    def run(make_optimizer: Any, label: str) -> tuple[nn.Module, float]:
        torch.manual_seed(args.seed)
        backbone = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
        model = nn.Sequential(backbone, nn.Linear(32, 10)).double()
        backbone.requires_grad_(False)  # phase 1: the head only
        head = model[1]
        opt = make_optimizer(
            [
                {"params": [head.weight], "weight_decay": 0.05},
                {"params": [head.bias], "weight_decay": 0.0},
            ]
        )
        steps = args.head_epochs * len(batches)
        sched: Any = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)

        def epoch() -> float:
            for b in batches:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x[b]), y[b])
                loss.backward()
                opt.step()
                sched.step()
            return float(loss.detach())

        for _ in range(args.head_epochs):
            loss = epoch()
        print(f"{label}: head only, {steps} steps with OneCycleLR: loss {loss:.4f}")

        backbone.requires_grad_(True)  # phase 2: unfreeze, a group at a tenth of the lr
        decay = [p for p in backbone.parameters() if p.dim() == 2]
        no_decay = [p for p in backbone.parameters() if p.dim() != 2]
        opt.add_param_group({"params": decay, "lr": args.lr / 10, "weight_decay": 0.05})
        opt.add_param_group({"params": no_decay, "lr": args.lr / 10, "weight_decay": 0.0})
        for g in opt.param_groups[:2]:
            g["lr"] = args.lr / 2  # the head restarts lower than its one-cycle peak
        steps = args.all_epochs * len(batches)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        for i in range(args.all_epochs):
            if i == args.all_epochs - 1:
                opt.param_groups[2]["weight_decay"] = 0.2  # a hand-written change
            loss = epoch()
        print(f"{label}: all layers, {args.all_epochs} epochs with cosine: loss {loss:.4f}")
        with torch.no_grad():
            acc = float((model(x[test]).argmax(1) == y[test]).double().mean())
        return model, acc

    ref, ref_acc = run(lambda groups: torch.optim.AdamW(groups, lr=args.lr), "torch.optim.AdamW")
    ours, acc = run(lambda groups: fg.Optimizer(groups, fg.adamw(lr=args.lr)), "fg.Optimizer")
    diff = max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
    )
    print(f"test accuracy: torch.optim {ref_acc:.3f}, funcgrad {acc:.3f}")
    print(f"largest parameter difference between the two runs: {diff:.1e}")
    from _cli import summary

    summary("torch_idioms", test_acc=acc, torch_test_acc=ref_acc, max_diff=diff)
    return {"accuracy": acc, "torch_accuracy": ref_acc, "max_diff": diff}


if __name__ == "__main__":
    main(sys.argv[1:])
