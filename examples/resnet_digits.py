"""A small ResNet with train-mode BatchNorm on scikit-learn's digits, two ways.

  (a) torch.optim   AdamW with a decay and a no-decay param group, LinearLR warmup +
                    CosineAnnealingLR in a SequentialLR, eager loss.backward()
  (b) funcgrad      fg.adamw(mask=...) with fg.warmup_cosine_decay, fg.monitor per
                    layer, one compiled, donated fg.make_step(buffers=True)

Same seed, initialisation, data order and budget. BatchNorm runs in train mode in
both: in (b) its running statistics are explicit inputs and outputs of the pure
step (``buffers=True``), written back into the module, so ``model.eval()`` after
training uses them. Weight decay stays off biases and BatchNorm weights in both.

It prints a table (accuracy, loss, speed, compile time), the per-layer gradient
statistics that fg.monitor kept, and writes a PNG with the loss curves and the
learning-rate schedule.

Run: ``python examples/resnet_digits.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

from _cli import ShowDefaults


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(
        formatter_class=ShowDefaults,
        description="small ResNet with train-mode BatchNorm on digits",
    )
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    ap.add_argument("--weight-decay", type=float, default=5e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="run the funcgrad step eagerly")
    ap.add_argument("--out", type=Path, default=Path("out"), help="output directory")
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
from _cli import check_out_dir, summary
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import funcgrad as fg


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """8x8 digits: stem, two blocks at full resolution, one at 4x4, pool, linear."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))
        self.layer1 = nn.Sequential(Block(width, width, 1), Block(width, width, 1))
        self.layer2 = Block(width, 2 * width, 2)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.stem(x))))
        return self.head(x.mean((2, 3)))


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on conv and linear weights only (not biases, not BatchNorm)."""
    return p.ndim > 1


def load_data(seed: int):
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    return Xtr, Xte, torch.tensor(ytr), torch.tensor(yte)


def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()  # the running statistics, as after any training
    with torch.no_grad():
        acc = (model(X).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def train(kind: str, args: argparse.Namespace, data, init: nn.Module) -> dict:
    Xtr, Xte, ytr, yte = data
    model = copy.deepcopy(init)
    steps_per_epoch = len(Xtr) // args.batch
    total = args.epochs * steps_per_epoch
    warmup = max(1, total // 10)
    lrs: list[float] = []
    losses: list[float] = []
    if kind == "torch.optim":
        named = dict(model.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named.items() if decays(n, p)]},
                {"params": [p for n, p in named.items() if not decays(n, p)], "weight_decay": 0.0},
            ],
            lr=args.lr,
            weight_decay=args.weight_decay,
        )
        sched = torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, 1e-2, 1.0, total_iters=warmup),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup),
            ],
            milestones=[warmup],
        )
    else:
        schedule = fg.warmup_cosine_decay(args.lr * 1e-2, args.lr, warmup, total)
        groups = fg.group_by_module(model)
        tx = fg.named_chain(
            ("monitor", fg.monitor(groups)),
            ("adamw", fg.adamw(lr=schedule, weight_decay=args.weight_decay, mask=decays)),
        )

        def loss_fn(p, b, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)

        step = fg.make_step(loss_fn, tx, buffers=True, compile=not args.no_compile, donate=True)
        params, buffers = fg.params(model), fg.buffers(model)
        state = tx.init(params)

    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(total=total, desc=f"{kind:11s}", mininterval=0.5)
    t0 = time.perf_counter()
    t_first = None
    zero_frac: dict[str, list[float]] = {}
    for _ in range(args.epochs):
        order = torch.randperm(len(Xtr), generator=gen)[: steps_per_epoch * args.batch]
        for idx in order.view(steps_per_epoch, args.batch):
            x, y = Xtr[idx], ytr[idx]
            if kind == "torch.optim":
                lrs.append(opt.param_groups[0]["lr"])
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
            else:
                lrs.append(float(schedule(state["adamw"].count.to(torch.float64))))
                params, state, buffers, loss = step(params, state, buffers, x, y)
                for g, s in state["monitor"].stats.items():
                    zero_frac.setdefault(g, []).append(float(s["zero_fraction"]))
            if t_first is None:
                t_first = time.perf_counter()  # the first step includes compilation
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    elapsed = time.perf_counter() - (t_first or t0)
    return {
        "kind": kind,
        "train_acc": accuracy(model, Xtr, ytr),
        "test_acc": accuracy(model, Xte, yte),
        "final_loss": sum(losses[-steps_per_epoch:]) / steps_per_epoch,
        "steps_per_s": (len(losses) - 1) / elapsed if len(losses) > 1 else math.nan,
        "first_step_s": (t_first or t0) - t0,
        "losses": losses,
        "lrs": lrs,
        "zero_frac": {g: sum(v) / len(v) for g, v in zero_frac.items()},
    }


def table(results: list[dict]) -> str:
    head = f"{'run':12s} {'train acc':>9s} {'test acc':>9s} {'loss':>7s} {'steps/s':>8s}"
    head += f" {'1st step s':>10s}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r['kind']:12s} {r['train_acc']:9.3f} {r['test_acc']:9.3f} {r['final_loss']:7.3f}"
            f" {r['steps_per_s']:8.1f} {r['first_step_s']:10.1f}"
        )
    rows.append("1st step s: the first step's time (compilation for funcgrad compiled).")
    zf = results[-1]["zero_frac"]
    if zf:
        worst = max(zf, key=lambda g: zf[g])
        rows.append(
            f"fg.monitor: exactly-zero gradient entries, mean over steps, worst of "
            f"{len(zf)} layers: {zf[worst]:.3f} ({worst})"
        )
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        ax1.plot(r["losses"], label=r["kind"], lw=1)
        ax2.plot(r["lrs"], label=r["kind"], lw=1, ls="-" if r["kind"] == "funcgrad" else "--")
    ax1.set(title="training loss per step", xlabel="step", ylabel="cross-entropy", yscale="log")
    ax2.set(title="learning rate (warmup + cosine)", xlabel="step", ylabel="lr")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.epochs < 1 or args.width < 1:
        ap.error("--epochs and --width must be >= 1")
    if not 2 <= args.batch <= 1000:
        ap.error(f"--batch must be in [2, 1000] (BatchNorm needs two samples), got {args.batch}")
    check_out_dir(ap, args.out)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.manual_seed(args.seed)
    data = load_data(args.seed)
    init = ResNet(args.width)
    results = [train(kind, args, data, init) for kind in ("torch.optim", "funcgrad")]
    print()
    print(table(results))
    png = args.out / "resnet_digits.png"
    plot(results, png)
    rows = [{k: v for k, v in r.items() if k not in ("losses", "lrs")} for r in results]
    (args.out / "resnet_digits.json").write_text(json.dumps(rows, indent=2))
    print(f"\nfigure: {png.resolve()}")
    torch_run, fg_run = results
    summary(
        "resnet_digits",
        test_acc_torch_optim=torch_run["test_acc"],
        test_acc_funcgrad=fg_run["test_acc"],
        steps_per_s_ratio=fg_run["steps_per_s"] / torch_run["steps_per_s"],
    )
    return {"results": rows, "png": str(png)}


if __name__ == "__main__":
    main()
