"""Exact-zero tests are fragile: gradients that are mathematically zero, measured.

Two parameters have a true gradient of exactly zero whatever the data:

- the key part of an attention layer's input bias (``nn.MultiheadAttention``'s
  ``in_proj_bias[E:2E]``): adding the same vector to every key shifts every
  attention score of a query by the same amount, and softmax ignores that shift;
- a convolution's bias right before a BatchNorm: the batch mean subtracts it again.

In floating point they come out as exact zeros on some entries and as noise of
about 1e-18 on others, and which entries is up to the kernels, so up to the CPU
(MKL and torch pick other code paths on other processors): where eager torch and
the torch.compile'd step disagree, the seed's rule turns one's exact zeros into 0.5
and leaves the other's noise alone (Adam then blows the noise up to a full-size
step), and two correct implementations of the same rule end far apart on exactly
these tensors. Whether they disagree is measured here, on the machine that runs
this, and printed ("the trap showed" or not): on an AMD EPYC both models show it;
on an Intel Xeon (AVX-512) the attention model's bias came out 3.1e-10 apart.
With ``zero_fix(atol=1e-12)`` both see "zero" and agree on every machine.

This script trains a tiny attention model and a tiny conv+BatchNorm model for a
few steps, float64, dropout off, twice: eager ``torch.optim.Adam`` with the rule
applied to ``.grad`` by a plain loop (the reference), and the compiled funcgrad
step; it prints the largest relative difference per tensor.

Run: python examples/exact_zeros.py [--steps N] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy

from _cli import ShowDefaults, summary


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(formatter_class=ShowDefaults, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--no-compile", action="store_true", help="run the funcgrad step eagerly")
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
from torch import nn

import funcgrad as fg

E, VOCAB = 16, 20
TRAPS = {"attention": "attn.in_proj_bias", "conv+bn": "conv.bias"}
"""The tensor of each model whose true gradient is zero (see the module docstring)."""
TRAP = 1e-3
"""A relative difference above this with ``atol=0`` means the exact-zero test flipped."""


class TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, E)
        self.attn = nn.MultiheadAttention(E, 2, batch_first=True)
        self.head = nn.Linear(E, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        causal = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], dtype=h.dtype)
        a, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        return self.head(h + a)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)  # bias=True: its true gradient is zero
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def reference_rule(group: dict[str, torch.Tensor], atol: float) -> dict[str, torch.Tensor]:
    """The seed's rule with plain Python branches, |g| <= atol counting as zero."""
    if all(bool((g.abs() <= atol).all()) for g in group.values()):
        return {k: torch.ones_like(g) for k, g in group.items()}
    return {k: torch.where(g.abs() <= atol, torch.full_like(g, 0.5), g) for k, g in group.items()}


def task(name: str):
    g = torch.Generator().manual_seed(0)
    if name == "attention":
        idx = torch.randint(0, VOCAB, (8, 9), generator=g)

        def loss(out, batch):
            return nn.functional.cross_entropy(out.reshape(-1, VOCAB), batch[1].reshape(-1))

        return TinyAttention, (idx[:, :-1], idx[:, 1:]), loss
    x = torch.randn(8, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    return ConvBN, (x, y), lambda out, batch: nn.functional.cross_entropy(out, batch[1])


def run(name: str, steps: int, atol: float, compile: bool) -> dict[str, float]:
    make, batch, loss = task(name)
    torch.manual_seed(0)
    ref = make().double()
    model = copy.deepcopy(ref)
    groups = fg.group_by_module(ref)

    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    named = dict(ref.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss(ref(batch[0]), batch).backward()
        for names in groups.values():
            fixed = reference_rule({n: named[n].grad for n in names}, atol)
            for n in names:
                named[n].grad = fixed[n]
        opt.step()

    tx = fg.chain(fg.per_group(fg.rules.zero_fix(atol=atol), groups), fg.adam(lr=0.01))
    if name == "attention":

        def loss_fn(p, x, y):
            return loss(fg.call(model, p, x), (x, y))

        step = fg.make_step(loss_fn, tx, compile=compile, donate=True)
        params = fg.params(model)
        state = tx.init(params)
        for _ in range(steps):
            params, state, _ = step(params, state, *batch)
    else:

        def loss_bn(p, b, x, y):
            return loss(fg.call(model, p, x, buffers=b), (x, y))

        step = fg.make_step(loss_bn, tx, compile=compile, donate=True, buffers=True)
        params, buffers = fg.params(model), fg.buffers(model)
        state = tx.init(params)
        for _ in range(steps):
            params, state, buffers, _ = step(params, state, buffers, *batch)
    return {
        n: float((params[n] - named[n].detach()).abs().max() / named[n].detach().abs().max())
        for n in params
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    ap = parser()
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in ("attention", "conv+bn"):
        results[name] = {}
        for atol in (0.0, 1e-12):
            torch._dynamo.reset()
            diffs = run(name, args.steps, atol, compile=not args.no_compile)
            results[name][f"atol={atol:g}"] = diffs
    print(f"max relative difference to eager torch.optim + the rule, {args.steps} steps, float64")
    print(f"{'model':10s} {'tensor':22s} {'atol=0':>10s} {'atol=1e-12':>11s}")
    for name, by_atol in results.items():
        for tensor in by_atol["atol=0"]:
            a, b = by_atol["atol=0"][tensor], by_atol["atol=1e-12"][tensor]
            print(f"{name:10s} {tensor:22s} {a:10.2e} {b:11.2e}")
    for name, tensor in TRAPS.items():
        flipped = results[name]["atol=0"][tensor] > TRAP
        print(
            f"{name}: the trap {'showed' if flipped else 'did not show'} on this machine "
            f"({tensor}: {results[name]['atol=0'][tensor]:.2e} apart with atol=0)"
        )
    worst = {
        f"{name.replace('+', '_')}_{'atol0' if atol == 'atol=0' else 'atol1e-12'}": max(d.values())
        for name, by_atol in results.items()
        for atol, d in by_atol.items()
    }
    summary("exact_zeros", steps=args.steps, **worst)
    return results


if __name__ == "__main__":
    main()
