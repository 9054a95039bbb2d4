"""Design study for issue #13: would flat buffers make the one-graph step compile faster?

STYLE.md and #13 name "parameters and moments kept in a few flat buffers with
per-name views" as the lever for the compile time of ``make_step(compile=True)``.
This script measures that before funcgrad's state layout changes. It is a study,
not funcgrad's code path: the flat variants are hand-written steps (``fg.rules.zero_fix``
per layer + Adam, donated) that funcgrad does not offer.

Variants, each compiled in a fresh process with empty inductor caches (the
``cold_caches`` of bench_step.py), first call then median step:

* ``grad``        ``torch.compile(torch.func.grad_and_value(loss))`` over one tensor per
  parameter (#13's reference: the model's own gradients)
* ``step``        ``fg.make_step(..., compile=True, donate=True)`` on ``fg.params(model)``,
  as shipped: the flat layout since #21
* ``step-dict``   the same on a params dict built by hand: the per-tensor layout
  (funcgrad as shipped before #21)
* ``eager``, ``eager-dict``  the same two steps not compiled (``compile=False``)
* ``flat-state``  Adam's two moments each one flat buffer (params stay per tensor):
  the rule per layer, ``cat`` of the fixed gradients, Adam on the flat vectors,
  each parameter updated from its slice of the flat update
* ``flat-all``    the parameters in one flat buffer too (the model's tensors are
  views of it): the whole update is elementwise over three flat buffers
* ``flat-seg``    ``flat-all`` with the gradient taken with respect to the flat buffer
  (one flat gradient), and the seed rule over all groups at once: one segmented
  reduction (``torch.segment_reduce`` over the groups' lengths) for every group's
  all-zero flag, broadcast back with ``repeat_interleave``; nothing per tensor is
  left in the update (issue #21's design question)
* ``flat-idx``    ``flat-seg`` with the segmented reduction as inductor code: each
  entry's group index (an int32 buffer made once), ``scatter_reduce(amax)`` of the
  nonzero flags into one flag per group, and ``flags[index]`` gathered back inside
  the elementwise rule

Models: bench_step.py's MLP (``--layers 0``, target 1) and ``L`` blocks of
``Linear(64, 64) + ReLU`` as in bench_scaling.py (target 4).

Run: python benchmarks/study_flat_state.py [--layers 0 10 40] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import grad_and_value

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_scaling import batch, model
from bench_step import cold_caches, interleaved, mlp, per_name

B1, B2, LR, EPS = 0.9, 0.999, 1e-3, 1e-8
VARIANTS = (
    "grad", "step", "step-dict", "eager", "eager-dict", "flat-state", "flat-all", "flat-seg",
    "flat-idx",
)  # fmt: skip
Loss = Callable[..., Tensor]


def setup(layers: int) -> tuple[nn.Module, Loss, Tensor, Tensor]:
    """The model, its loss ``loss(params, x, y)`` and one batch."""
    if layers == 0:
        torch.manual_seed(0)
        m = mlp()
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        return m, lambda p, x, y: nn.functional.cross_entropy(fg.call(m, p, x), y), x, y
    m = model(layers, 64)
    x, y = batch(64)
    return m, lambda p, x, y: ((fg.call(m, p, x) - y) ** 2).mean(), x, y


def flat_step(
    m: nn.Module,
    loss: Loss,
    flat_params: bool,
    compile: bool = True,
    segmented: bool | str = False,
) -> tuple[Callable, tuple]:
    """A hand-written donated step (seed rule per layer, Adam) over flat moments, and
    over flat parameters too with ``flat_params``; returns ``(step, args)``."""
    named = {k: p.detach() for k, p in m.named_parameters()}
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for k, p in named.items():
        spans[k] = (offset, p.numel())
        offset += p.numel()
    groups = fg.group_by_module(m)
    rule = fg.rules.zero_fix()  # the shipped step's rule, per group

    def update(grads: dict[str, Tensor], mu: Tensor, nu: Tensor, count: Tensor):
        fixed: dict[str, Tensor] = {}
        for keys in groups.values():
            fixed.update(rule({k: grads[k] for k in keys}))
        return flat_adam(torch.cat([fixed[k].reshape(-1) for k in named]), mu, nu, count)

    def flat_adam(g: Tensor, mu: Tensor, nu: Tensor, count: Tensor):
        """Adam on flat vectors: ``(update, mu, nu)``."""
        c = (count + 1).to(torch.float64)
        inv_bc2 = (1 - B2**c).rsqrt().to(torch.float32)
        step_size = (LR / (1 - B1**c)).to(torch.float32)
        m_new = torch.lerp(mu, g, 1 - B1)
        v_new = nu * B2 + ((1 - B2) * g) * g
        return -step_size * m_new / (torch.sqrt(v_new) * inv_bc2 + EPS), m_new, v_new

    def views(flat: Tensor) -> dict[str, Tensor]:
        return {k: flat[a : a + n].view(named[k].shape) for k, (a, n) in spans.items()}

    # flat-seg: every group is one contiguous segment of the flat buffer (a module's
    # own parameters come one after the other in named_parameters' order).
    order = [k for keys in groups.values() for k in keys]
    if segmented and order != list(named):
        raise SystemExit("flat-seg needs each group to be one segment in parameter order")
    lengths = torch.tensor([sum(named[k].numel() for k in keys) for keys in groups.values()])

    def seg_rule(g: Tensor) -> Tensor:
        """zero_fix() on every group of the flat gradient at once."""
        nonzero = torch.segment_reduce((g != 0).to(g.dtype), "max", lengths=lengths)
        dead = torch.repeat_interleave(nonzero == 0, lengths, output_size=g.numel())
        return torch.where(dead, 1.0, torch.where(g == 0, 0.5, g))

    index = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)

    def idx_rule(g: Tensor) -> Tensor:
        """seg_rule with a scatter and a gather that inductor generates."""
        at = index.long()
        nonzero = torch.zeros(len(lengths), dtype=g.dtype).scatter_reduce(
            0, at, (g != 0).to(g.dtype), "amax"
        )
        dead = nonzero[at] == 0
        return torch.where(dead, 1.0, torch.where(g == 0, 0.5, g))

    def seg_update(g: Tensor, mu: Tensor, nu: Tensor, count: Tensor):
        return flat_adam(idx_rule(g) if segmented == "idx" else seg_rule(g), mu, nu, count)

    if flat_params:
        flat = torch.cat([p.reshape(-1) for p in named.values()])
        with torch.no_grad():  # the module's parameters become views of the flat buffer
            for k, v in views(flat).items():
                m.get_parameter(k).data = v

        def step_all(p_flat, mu, nu, count, x, y):
            if segmented:
                g, value = grad_and_value(lambda f, x, y: loss(views(f), x, y))(p_flat, x, y)
                u, m_new, v_new = seg_update(g, mu, nu, count)
            else:
                grads, value = grad_and_value(loss)(views(p_flat), x, y)
                u, m_new, v_new = update(grads, mu, nu, count)
            p_flat.add_(u)
            mu.copy_(m_new)
            nu.copy_(v_new)
            count.add_(1)
            return value

        fn, first = step_all, flat
    else:

        def step_state(params, mu, nu, count, x, y):
            grads, value = grad_and_value(loss)(params, x, y)
            u, m_new, v_new = update(grads, mu, nu, count)
            for k, (a, n) in spans.items():
                params[k].add_(u[a : a + n].view(named[k].shape))
            mu.copy_(m_new)
            nu.copy_(v_new)
            count.add_(1)
            return value

        fn, first = step_state, named
    state = (torch.zeros(offset), torch.zeros(offset), torch.zeros((), dtype=torch.int64))
    return (torch.compile(fn, fullgraph=True) if compile else fn), (first, *state)


def check(layers: int, steps: int = 3) -> float:
    """The largest relative difference between the flat variants, run eagerly, and
    funcgrad's eager step after ``steps`` steps (the study compares like with like)."""
    worst = 0.0
    m, loss, x, y = setup(layers)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam())
    params = fg.params(m)
    state = tx.init(params)
    step = fg.make_step(loss, tx, donate=True)
    for _ in range(steps):
        step(params, state, x, y)
    variants: tuple[tuple[bool, bool | str], ...] = (
        (False, False), (True, False), (True, True), (True, "idx"),
    )  # fmt: skip
    for flat_params, segmented in variants:
        m2, loss2, _, _ = setup(layers)
        fn, args = flat_step(m2, loss2, flat_params, compile=False, segmented=segmented)
        for _ in range(steps):
            fn(*args, x, y)
        for k, p in m2.named_parameters():
            diff = (p.detach() - params[k]).abs().max() / params[k].abs().max()
            worst = max(worst, float(diff))
    return worst


def make_call(layers: int, variant: str) -> Callable[[], object]:
    """One step of ``variant`` on the model of ``layers``, not yet called (also
    ``"adam"``: funcgrad's compiled step without the rule, for bench_compile_cpu.py)."""
    m, loss, x, y = setup(layers)
    if variant == "grad":  # the model's own gradients, one tensor per parameter
        f = torch.compile(grad_and_value(loss), fullgraph=True)
        params = per_name(m)  # m is not flattened: separate tensors
        call: Callable[[], object] = lambda: f(params, x, y)  # noqa: E731
    elif variant in ("adam", "step", "step-dict", "eager", "eager-dict"):
        tx: fg.GradientTransformation = fg.adam()
        if variant != "adam":
            tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), tx)
        # the per-tensor layout (a dict built by hand), or the flat one since #21
        params = per_name(m) if variant.endswith("-dict") else fg.params(m)
        state = tx.init(params)
        step = fg.make_step(loss, tx, compile=not variant.startswith("eager"), donate=True)
        call = lambda: step(params, state, x, y)  # noqa: E731
    else:
        compiled, args = flat_step(
            m,
            loss,
            flat_params=variant != "flat-state",
            segmented={"flat-seg": True, "flat-idx": "idx"}.get(variant, False),
        )
        call = lambda: compiled(*args, x, y)  # noqa: E731
    return call


def child(layers: int, variant: str) -> dict[str, float]:
    call = make_call(layers, variant)
    t = time.perf_counter()
    call()
    first = time.perf_counter() - t
    return {"first_call_s": first, "step_s": interleaved({"f": call}, 7, 20, warmup=1)["f"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 10, 40])
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; min kept")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1])))
        return
    results: dict[str, dict[str, dict[str, float]]] = {}
    for layers in args.layers:
        name = "MLP 256-512-512-512-10" if layers == 0 else f"{layers} x Linear(64, 64)"
        # (the hand-written flat variants are checked against funcgrad's step when run)
        diff = check(layers) if any(v.startswith("flat") for v in args.variants) else 0.0
        if diff > 1e-5:
            raise SystemExit(f"{name}: the flat steps differ from funcgrad's by {diff:.1e}")
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for variant in args.variants:
                with tempfile.TemporaryDirectory() as cache:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", str(layers), variant],
                        env={**os.environ, **cold_caches(cache)},
                        capture_output=True, text=True, check=True,
                    )  # fmt: skip
                r = json.loads(out.stdout.strip().splitlines()[-1])
                old = best.get(variant, r)
                best[variant] = {k: min(r[k], old[k]) for k in r}
        results[name] = best
        ref = best.get("grad", next(iter(best.values())))  # else: the first variant
        print(f"{name} (flat steps equal funcgrad's eager step to {diff:.1e}):")
        print("  first call (fresh process, empty caches) and step, ratio to grad")
        for variant, r in best.items():
            first, ms = r["first_call_s"], r["step_s"] * 1e3
            print(
                f"  {variant:10s} {first:6.1f} s ({first / ref['first_call_s']:4.2f}x)"
                f"   step {ms:7.3f} ms ({r['step_s'] / ref['step_s']:4.2f}x)",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study_flat_state.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
