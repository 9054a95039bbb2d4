"""DP-SGD-style training with per-sample rules, on scikit-learn's digits (no download).

Each step clips every sample's gradient inside one compiled graph:
  1. per sample: clipping of the whole per-sample gradient to global norm
     ``--max-norm``: by default with ``fg.ghost_clip`` (per-sample norms from each
     layer's inputs and output gradients, no per-sample gradients: one backward);
     with ``--no-ghost`` (or ``--zero-fix``, the zero-gradient rule per layer first,
     which needs each sample's gradient) under ``vmap``;
  2. the mean over the batch, plus Gaussian noise of std
     ``noise_multiplier * max_norm / batch`` from funcgrad's seeded, counter-based
     generator (reproducible, no global RNG);
  3. Adam.

This shows the mechanics only: no privacy accounting is done here, and the noise
generator is statistical, not cryptographic.

About ``--zero-fix`` per sample: one sample's gradient is mostly exact zeros (dead
ReLUs, blank input pixels), so the rule writes 0.5 into most entries, and after
clipping that constant dominates the signal: measured here, test accuracy falls from
0.89 to chance (0.10) in 5 epochs (defaults, seed 0). It is there to show that the
rule composes with vmap, not as advice.

Run: ``python examples/dp_sgd.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import time

from _cli import ShowDefaults, summary


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(
        formatter_class=ShowDefaults,
        description="DP-SGD-style training with funcgrad",
    )
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--zero-fix", action="store_true", help="apply the zero rule to each sample first"
    )
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--ghost", action=argparse.BooleanOptionalAction, default=True,
        help="clip with fg.ghost_clip (per-sample norms, one backward); --no-ghost: under vmap",
    )  # fmt: skip
    ap.add_argument(
        "--compare", action="store_true",
        help="first time 30 eager steps of both paths and print their steps/s",
    )  # fmt: skip
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import funcgrad as fg


def load(seed: int):
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    return Xtr, Xte, ytr, yte


def compare(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, max_norm: float) -> None:
    """Steps/s of the two clipping paths, eager, side by side (interleaved, after a
    first call of each)."""
    steps = {}
    for name, per_sample in (
        ("ghost", fg.ghost_clip(max_norm)), ("vmap", fg.clip_by_global_norm(max_norm)),
    ):  # fmt: skip
        tx = fg.adam(lr=1e-3)
        p = {k: v.clone() for k, v in fg.params(model).views().items()}
        steps[name] = (fg.make_step(loss_fn, tx, per_sample=per_sample), p, tx.init(p))
    for step, p, s in steps.values():  # first calls (checks, imports) not timed
        step(p, s, x, y)
    times = {k: 0.0 for k in steps}
    for _ in range(30):
        for name, (step, p, s) in steps.items():
            t = time.perf_counter()
            step(p, s, x, y)
            times[name] += time.perf_counter() - t
    rates = {k: 30 / v for k, v in times.items()}
    print(
        f"eager steps/s at batch {x.shape[0]}: ghost {rates['ghost']:.0f}, vmap "
        f"{rates['vmap']:.0f} ({rates['ghost'] / rates['vmap']:.2f}x)"
    )
    rise = {name: peak_rise_mib(lambda s=s: s[0](s[1], s[2], x, y)) for name, s in steps.items()}
    if all(v is not None for v in rise.values()):
        print(
            f"peak memory rise over 5 steps: ghost {rise['ghost']:.1f} MiB, vmap "
            f"{rise['vmap']:.1f} MiB (Linux VmHWM; the process's other memory not counted)"
        )


def peak_rise_mib(run) -> float | None:
    """How far the process's peak resident memory rises over 5 calls of ``run`` (MiB),
    from Linux's /proc (reset with clear_refs); None elsewhere."""
    status = "/proc/self/status"

    def kib(key: str) -> int:
        with open(status) as f:
            return int(f.read().split(key + ":")[1].split()[0])

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = kib("VmRSS")
    except OSError:
        return None
    for _ in range(5):
        run()
    return max(0.0, (kib("VmHWM") - base) / 1024)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = parser()
    args = ap.parse_args(argv)
    if args.epochs < 0 or args.batch < 1:
        ap.error("--epochs must be >= 0 and --batch >= 1")

    torch.manual_seed(args.seed)
    Xtr, Xte, ytr, yte = load(args.seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    ghost = args.ghost and not args.zero_fix
    if args.compare:
        compare(model, loss_fn, Xtr[: args.batch], ytr[: args.batch], args.max_norm)
    per_sample = fg.ghost_clip(args.max_norm) if ghost else fg.clip_by_global_norm(args.max_norm)
    if args.zero_fix:
        per_sample = fg.chain(
            fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), per_sample
        )
    tx = fg.chain(
        fg.add_noise(args.noise_multiplier * args.max_norm / args.batch, seed=args.seed),
        fg.adam(lr=args.lr),
    )
    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(
        loss_fn, tx, per_sample=per_sample, compile=not args.no_compile, donate=True
    )

    gen = torch.Generator().manual_seed(args.seed)
    n = (Xtr.shape[0] // args.batch) * args.batch  # whole batches: one compiled shape
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        order = torch.randperm(Xtr.shape[0], generator=gen)[:n].view(-1, args.batch)
        for idx in order:
            params, state, loss = step(params, state, Xtr[idx], ytr[idx])
        print(f"epoch {epoch + 1}: last batch loss {loss.item():.4f}")
    with torch.no_grad():
        acc = (model(Xte).argmax(1) == yte).float().mean().item()
    how = "fg.ghost_clip" if ghost else "vmap"
    print(
        f"test accuracy {acc:.3f} after {args.epochs} epochs ({time.perf_counter() - t0:.1f} s, "
        f"clipped with {how})"
    )
    summary("dp_sgd", epochs=args.epochs, test_acc=acc, loss=loss.item())
    return {"test_accuracy": acc, "loss": loss.item(), "ghost": ghost}


if __name__ == "__main__":
    main()
