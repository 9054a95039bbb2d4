"""funcgrad inside PyTorch Lightning: ``configure_optimizers`` returns ``fg.Optimizer``.

A ``LightningModule`` as people already write it, training a small classifier on
scikit-learn's digits with a ReLU layer that starts half dead. ``configure_optimizers``
returns ``fg.Optimizer`` (the seed rule: all-zero layer -> 1.0, zero entries -> 0.5; a
per-layer monitor; AdamW) with a cosine schedule stepped every batch; Lightning's loop
calls ``opt.step(closure)``. A callback prints, per epoch, what the monitor saw in each
layer's gradients; then the test accuracy.

Needs ``pip install "funcgrad[integrations]"`` (Lightning).
Run: ``python examples/lightning_fit.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=6, help="passes over the data (default 6)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's initial lr (default 3e-3)")
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = ap.parse_args(argv)
    if args.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {args.epochs}")

    import lightning as L  # after argparse: --help answers at once
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import funcgrad as fg

    torch.manual_seed(args.seed)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x))
    train, test = perm[:1400], perm[1400:]
    loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=100, shuffle=True)
    steps = args.epochs * len(loader)

    class Digits(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
            with torch.no_grad():
                self.net[0].bias[:32].fill_(-50.0)  # half of the hidden units start dead

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            xb, yb = batch
            return nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            groups = fg.group_by_module(self.net)
            tx = fg.named_chain(
                ("monitor", fg.monitor(groups, stats=("zero_fraction", "all_zero"))),
                ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
                ("adamw", fg.adamw(lr=args.lr, weight_decay=0.01)),
            )
            opt = fg.Optimizer(self.net, tx)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Report(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            opt = trainer.optimizers[0]
            stats = opt.tx_state["monitor"].stats  # the last step's, per layer
            layers = "  ".join(
                f"layer {g}: zero fraction {float(s['zero_fraction']):.2f}"
                for g, s in stats.items()
            )
            print(f"epoch {trainer.current_epoch}: lr {opt.param_groups[0]['lr']:.2e}  {layers}")

    module = Digits()
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Report()],
    )
    trainer.fit(module, train_dataloaders=loader)
    with torch.no_grad():
        acc = float((module.net(x[test]).argmax(1) == y[test]).float().mean())
    print(f"test accuracy {acc:.3f} after {steps} steps (Lightning + fg.Optimizer + cosine lr)")
    from _cli import summary

    summary("lightning_fit", steps=steps, test_acc=acc)
    return {"accuracy": acc}


if __name__ == "__main__":
    main(sys.argv[1:])
