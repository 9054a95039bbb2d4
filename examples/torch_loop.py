"""funcgrad inside a plain torch.optim training loop: fg.Optimizer.

A loop as people already write it (``loss.backward()``, ``opt.step()``, an LR
scheduler, ``torch.amp.GradScaler``), training a small classifier on scikit-learn's
digits with a ReLU layer that starts half dead. ``fg.Optimizer`` runs the seed rule
(all-zero layer -> 1.0, zero entries -> 0.5), a per-layer monitor and AdamW in
``opt.step()``; the scheduler drives AdamW's learning rate through
``param_groups[0]["lr"]``; the scaler unscales before the rule, so the rule acts in the
loss's own units. Prints, per epoch, the loss, the learning rate and how many zero
gradient entries the monitor saw, then the test accuracy.

Run: ``python examples/torch_loop.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak lr (default 3e-3)")
    ap.add_argument(
        "--scale", type=float, default=2.0**12, help="GradScaler init_scale (default 4096)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = ap.parse_args(argv)
    if args.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {args.epochs}")

    import torch  # after argparse: --help answers at once
    from sklearn.datasets import load_digits
    from torch import nn

    import funcgrad as fg

    torch.manual_seed(args.seed)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x))
    train, test = perm[:1400], perm[1400:]
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[0].bias[:32].fill_(-50.0)  # half of the hidden units start dead

    groups = fg.group_by_module(model)
    tx = fg.named_chain(
        ("monitor", fg.monitor(groups, stats=("zero_fraction", "all_zero"))),
        ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
        ("adamw", fg.adamw(lr=args.lr, weight_decay=0.01)),
    )
    opt = fg.Optimizer(model, tx)
    steps = args.epochs * 14
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=steps, cycle_momentum=False
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=args.scale)
    for epoch in range(args.epochs):
        zeros = 0.0
        for batch in train.split(100):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            scaler.scale(loss).backward()
            scaler.step(opt)  # unscales .grad, then the rule, monitor and AdamW
            scaler.update()
            sched.step()
            zeros += float(opt.tx_state["monitor"].stats["0"]["zero_fraction"])
        print(
            f"epoch {epoch}: loss {float(loss.detach()):.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
            f"mean zero fraction of layer 0's gradients {zeros / 14:.2f}"
        )
    with torch.no_grad():
        acc = float((model(x[test]).argmax(1) == y[test]).float().mean())
    print(f"test accuracy {acc:.3f} after {steps} steps (fg.Optimizer + OneCycleLR + GradScaler)")
    from _cli import summary

    summary("torch_loop", steps=steps, test_acc=acc, loss=float(loss.detach()))
    return {"accuracy": acc, "loss": float(loss.detach())}


if __name__ == "__main__":
    main(sys.argv[1:])
