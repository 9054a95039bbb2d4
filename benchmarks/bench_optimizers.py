"""Each optimizer of #24 against torch.optim's own fast paths, side by side in one run.

The update-heavy model (``layers`` square matrices, 30% zero gradients, loss
``sum(p * G)``: the backward is trivial, the update is all), one optimizer at a time,
timed round-robin (median of repeats; these machines are shared and noisy):

  fg-comp     fg.make_step(compile=True, donate=True): gradients + update, one graph
  fg-eager    fg.make_step(donate=True), eager (the flat buffers for the elementwise ones)
  torch       loss.backward() + torch.optim's fastest eager path here: fused where torch
              has a fused CPU kernel (SGD, Adagrad), else foreach (RMSprop, Adafactor),
              single-tensor for Muon (the only one it has); Lion has no torch twin: a
              hand-written foreach Lion stands in
  torch-comp  loss.backward() + torch.compile(opt.step) (PyTorch's compiled-optimizer
              recipe; the hand-written Lion compiled for Lion)

No rule in any variant (the optimizers alone). Muon runs on ``--muon-width`` matrices
(default 128): its Newton-Schulz iteration is in bfloat16, which this CPU computes ~60x
slower than float32 (a 512 x 512 iteration takes ~2 s here), in torch as in funcgrad.
Printed: ms per step and the ratios fg-comp / torch, fg-comp / torch-comp,
fg-eager / torch; and the first call of fg-comp and torch-comp (compile included, in
seconds; a fresh inductor cache per run).

Run: python benchmarks/bench_optimizers.py [--quick] [--only sgd muon ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fg-bench-opt-"))

import torch
from common import RESULTS, interleaved
from torch import nn

import funcgrad as fg

OPTIMIZERS: dict[str, tuple[Callable[[], fg.GradientTransformation], Callable[..., object]]] = {
    "sgd": (
        lambda: fg.sgd(lr=0.01, momentum=0.9, weight_decay=1e-4),
        lambda ps, fast: torch.optim.SGD(
            ps, lr=0.01, momentum=0.9, weight_decay=1e-4, **_fast(fast, fused=True)
        ),
    ),
    "rmsprop": (
        lambda: fg.rmsprop(lr=0.01, momentum=0.9, centered=True),
        lambda ps, fast: torch.optim.RMSprop(
            ps, lr=0.01, momentum=0.9, centered=True, **_fast(fast)
        ),
    ),
    "adagrad": (
        lambda: fg.adagrad(lr=0.01, weight_decay=1e-4),
        lambda ps, fast: torch.optim.Adagrad(
            ps, lr=0.01, weight_decay=1e-4, **_fast(fast, fused=True)
        ),
    ),
    "adafactor": (
        lambda: fg.adafactor(lr=0.01, weight_decay=1e-4),
        lambda ps, fast: torch.optim.Adafactor(ps, lr=0.01, weight_decay=1e-4, **_fast(fast)),
    ),
    "muon": (
        lambda: fg.muon(lr=0.02),
        lambda ps, fast: torch.optim.Muon(ps, lr=0.02),
    ),
    "lion": (lambda: fg.lion(lr=1e-4, weight_decay=0.1), lambda ps, fast: ForeachLion(ps)),
}


def _fast(fast: bool, fused: bool = False) -> dict[str, bool]:
    """torch's fastest eager path: fused where it has a CPU kernel, else foreach; the
    single-tensor path (foreach=False) for the compiled recipe, which traces it."""
    if not fast:
        return {"foreach": False}
    return {"fused": True} if fused else {"foreach": True}


class ForeachLion(torch.optim.Optimizer):
    """The paper's Lion with torch._foreach_* ops: the torch-side stand-in (no twin)."""

    def __init__(self, params, lr=1e-4, b1=0.9, b2=0.99, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, b1=b1, b2=b2, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            gs = [p.grad for p in ps]
            ms = []
            for p in ps:
                if "mu" not in self.state[p]:
                    self.state[p]["mu"] = torch.zeros_like(p)
                ms.append(self.state[p]["mu"])
            b1, b2, lr, wd = group["b1"], group["b2"], group["lr"], group["weight_decay"]
            c = torch._foreach_mul(gs, 1 - b1)
            torch._foreach_add_(c, torch._foreach_mul(ms, b1))
            c = torch._foreach_sign(c)
            torch._foreach_add_(c, torch._foreach_mul(ps, wd))
            torch._foreach_add_(ps, c, alpha=-lr)
            torch._foreach_mul_(ms, b2)
            torch._foreach_add_(ms, gs, alpha=1 - b2)


def setup(name: str, variant: str, layers: int, width: int) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    G = {}
    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        g[torch.rand(p.shape, generator=gen) < 0.3] = 0.0
        G[n] = g
    make_tx, make_opt = OPTIMIZERS[name]
    if variant.startswith("fg"):
        tx = make_tx()
        params = fg.params(model)
        state = tx.init(params)

        def loss_fn(p):
            return sum((p[k] * G[k]).sum() for k in p)

        step = fg.make_step(loss_fn, tx, compile=variant == "fg-comp", donate=True)
        return lambda: step(params, state)
    opt: torch.optim.Optimizer = make_opt(model.parameters(), variant == "torch")  # type: ignore[assignment]
    named = dict(model.named_parameters())
    update = torch.compile(opt.step) if variant == "torch-comp" else opt.step

    def torch_step() -> None:
        opt.zero_grad()
        sum((named[k] * G[k]).sum() for k in named).backward()
        update()

    return torch_step


VARIANTS = ("fg-comp", "fg-eager", "torch", "torch-comp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 x 256 matrices, fewer repeats")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--muon-width", type=int, default=128)
    ap.add_argument("--only", nargs="*", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS),
        help="which variants to time side by side (fewer: less cache traffic between them)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (7; --quick 3)")
    ap.add_argument("--number", type=int, default=None, help="steps per timed block (5; --quick 3)")
    args = ap.parse_args()
    width = 256 if args.quick else args.width
    repeats, number = (3, 3) if args.quick else (7, 5)
    repeats, number = args.repeats or repeats, args.number or number
    if not args.variants:
        ap.error("--variants: name at least one")
    if args.variants != list(VARIANTS):
        return _some(args.only, args.variants, args.layers, width, args.muon_width, repeats, number)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.machine()}; "
        f"{args.layers} x ({width} x {width}), 30% zero gradients"
    )
    print(f"{'':16} {'fg-comp':>9} {'fg-eager':>9} {'torch':>9} {'torch-comp':>10}  (ms/step)"
          f"  comp/torch comp/t-comp eager/torch  first call fg / torch-comp (s)")  # fmt: skip
    # Load inductor and its compiler workers once, so that the first optimizer's first
    # call is not charged for them.
    torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(4))
    results: dict[str, dict[str, float]] = {}
    for name in args.only:
        fns, first = {}, {}
        size = min(width, args.muon_width) if name == "muon" else width
        for v in VARIANTS:
            fns[v] = setup(name, v, args.layers, size)
            if v.endswith("comp"):
                torch._dynamo.reset()
                t = time.perf_counter()
                fns[v]()
                first[v] = time.perf_counter() - t
        t = interleaved(fns, repeats, number)
        r = {
            "comp/torch": t["fg-comp"] / t["torch"],
            "comp/torch-comp": t["fg-comp"] / t["torch-comp"],
            "eager/torch": t["fg-eager"] / t["torch"],
        }
        results[name] = {**{f"{k}_s": v for k, v in t.items()}, **r}
        results[name].update({f"first_{k}_s": v for k, v in first.items()})
        print(
            f"{name + f' ({size})':16} " + " ".join(f"{t[v] * 1e3:9.2f}" for v in VARIANTS[:3])
            + f" {t['torch-comp'] * 1e3:10.2f}  {r['comp/torch']:10.2f}"
            f" {r['comp/torch-comp']:11.2f}"
            f" {r['eager/torch']:11.2f}  {first['fg-comp']:8.1f} / {first['torch-comp']:.1f}",
            flush=True,
        )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cores": os.cpu_count(), "layers": args.layers,
            "width": width, "muon_width": args.muon_width}  # fmt: skip
    (args.out / "bench_optimizers.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )


def _some(
    only: list[str],
    variants: list[str],
    layers: int,
    width: int,
    muon_width: int,
    repeats: int,
    number: int,
) -> None:
    """Only the chosen variants, side by side: ms per step and the first chosen one's
    time over each other's."""
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {layers} x ({width} x {width}); "
          f"{repeats} rounds of {number} steps")  # fmt: skip
    torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(4))  # inductor's workers
    for name in only:
        size = min(width, muon_width) if name == "muon" else width
        fns = {v: setup(name, v, layers, size) for v in variants}
        t = interleaved(fns, repeats, number)
        first = variants[0]
        cells = [f"{v} {t[v] * 1e3:.3f} ms" for v in variants]
        cells += [f"{first}/{v} {t[first] / t[v]:.2f}" for v in variants[1:]]
        print(f"{name:10s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
