"""The drop-in's speed: fg.Optimizer in an eager torch loop against torch.optim's fused
AdamW, side by side in one process (issue "The drop-in at fused speed").

Three workloads: an MLP 256-512-512-512-10 (662k parameters, batch 64), forty 64x64
layers (40 small tensors, batch 64), and three 3132x3132 layers (29.4M parameters,
batch 16). Every arm starts from the same weights and trains with AdamW(lr=1e-3,
weight_decay=1e-2). Arms, each a whole step (zero_grad, forward, backward, step):

  torch-fused       torch.optim.AdamW(fused=True): the reference, 1.00
  torch-foreach     torch.optim.AdamW(foreach=True)
  fg-eager          fg.Optimizer(model, fg.adamw())
  fg-compiled-step  the same with opt.step = torch.compile(opt.step)
  fg-make_step      fg.make_step(loss, fg.adamw(), compile=True, donate=True): the
                    forward, backward and update as one compiled graph
  heavyball         heavyball.AdamW (its compiled blocks), if heavyball is installed

and with the zero_fix rule per layer in front (``--rule`` arms, suffix ``+rule``):
torch-fused with the correct eager rule on ``.grad`` before ``opt.step()``,
fg.Optimizer(model, fg.chain(fg.per_group(zero_fix, groups), fg.adamw())), and the
same with ``opt.step = torch.compile(opt.step)`` (the rule and the update in one
generated kernel per buffer).

``update alone``: ``opt.step()`` only, on gradients computed once (the 29.4M model
shows the optimizer's own cost).

Timed round-robin (all arms of a workload interleaved, so drift hits all alike),
median of repeats, one thread by default (``--threads``). The ratios are to
torch-fused in the same run; absolute times are printed for context only.

``--optimizers``: instead, every elementwise optimizer's update alone (``opt.step()``
on gradients computed once) on the MLP and the 40-layer model: fg.Optimizer against
its torch.optim twin with ``foreach=True`` and, where torch has one, ``fused=True``
(ratios to torch-foreach).

``--rule-floor``: instead, why the eager rule cannot reach 1.4x: on one 3132x3132
gradient with 2% zeros, torch's fused AdamW update of it against each pass an eager
rule needs (finding a zero, the replacement into a kept buffer) and a compiled rule
block alone (one generated loop for ``all`` and ``where``, into a kept buffer), as
ratios to the fused update.

Run: python benchmarks/bench_drop_in.py [--quick] [--threads N] [--no-compile]
     [--device cuda] [--out DIR] [--optimizers | --rule-floor]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from common import RESULTS, RULE, eager_rule_on_grads, interleaved, mlp, write_json
from torch import nn

import funcgrad as fg

LR, WD = 1e-3, 1e-2


def workloads(quick: bool) -> dict[str, tuple[Callable[[], nn.Module], int, int, int]]:
    """name -> (model factory, input width, output width, batch)."""

    def many() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(40):
            layers += [nn.Linear(64, 64, bias=False), nn.Tanh()]
        return nn.Sequential(*layers)

    def big() -> nn.Module:
        w = 1024 if quick else 3132
        return nn.Sequential(
            nn.Linear(w, w, bias=False), nn.ReLU(), nn.Linear(w, w, bias=False), nn.ReLU(),
            nn.Linear(w, w, bias=False),
        )  # fmt: skip

    big_name = "3x1024^2 (3.1M)" if quick else "3x3132^2 (29.4M)"
    return {
        "MLP 662k": (mlp, 256, 10, 64),
        "40x64^2": (many, 64, 64, 64),
        big_name: (big, 1024 if quick else 3132, 1024 if quick else 3132, 16),
    }


def arms(
    make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, compile_arms: bool
) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """(whole-step arms, update-alone arms), each on its own copy of one model."""
    # Each compiled opt.step of another optimizer object is another entry of the one
    # code object's cache, whose limit (8) would send later arms back to eager.
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = make().to(x.device)

    def loss(m: nn.Module) -> torch.Tensor:
        return nn.functional.mse_loss(m(x), y)

    steps: dict[str, Callable[[], object]] = {}
    updates: dict[str, Callable[[], object]] = {}

    def loop(name: str, opt_of: Callable[[nn.Module], Any], rule: bool = False) -> None:
        m = copy.deepcopy(base)
        opt = opt_of(m)
        groups = fg.group_by_module(m)
        step = opt.step

        def whole() -> None:
            opt.zero_grad()
            loss(m).backward()
            if rule:
                eager_rule_on_grads(m, groups)
            step()

        steps[name] = whole
        u = copy.deepcopy(base)
        opt_u = opt_of(u)
        loss(u).backward()
        updates[name] = _update_alone(u, opt_u, rule)

    loop(
        "torch-fused", lambda m: torch.optim.AdamW(m.parameters(), LR, weight_decay=WD, fused=True)
    )
    loop(
        "torch-foreach",
        lambda m: torch.optim.AdamW(m.parameters(), LR, weight_decay=WD, foreach=True),
    )
    loop("fg-eager", lambda m: fg.Optimizer(m, fg.adamw(LR, weight_decay=WD)))
    try:
        import heavyball

        loop("heavyball", lambda m: heavyball.AdamW(m.parameters(), lr=LR, weight_decay=WD))
    except ImportError:
        pass
    if compile_arms:

        def compiled_opt(m: nn.Module) -> fg.Optimizer:
            opt = fg.Optimizer(m, fg.adamw(LR, weight_decay=WD))
            opt.step = torch.compile(opt.step)  # type: ignore[method-assign]
            return opt

        loop("fg-compiled-step", compiled_opt)
        m = copy.deepcopy(base)
        params, tx = fg.params(m), fg.adamw(LR, weight_decay=WD)
        state = tx.init(params)
        mstep = fg.make_step(
            lambda p, x, y: nn.functional.mse_loss(fg.call(m, p, x), y),
            tx,
            compile=True,
            donate=True,
        )
        steps["fg-make_step"] = lambda: mstep(params, state, x, y)
    loop(
        "torch-fused+rule",
        lambda m: torch.optim.AdamW(m.parameters(), LR, weight_decay=WD, fused=True),
        rule=True,
    )

    def with_rule(m: nn.Module) -> fg.Optimizer:
        rule = fg.per_group(RULE, fg.group_by_module(m))
        return fg.Optimizer(m, fg.chain(rule, fg.adamw(LR, weight_decay=WD)))

    loop("fg-eager+rule", with_rule)
    if compile_arms:

        def compiled_with_rule(m: nn.Module) -> fg.Optimizer:
            opt = with_rule(m)
            opt.step = torch.compile(opt.step)  # type: ignore[method-assign]
            return opt

        loop("fg-compiled-step+rule", compiled_with_rule)
    return steps, updates


def _update_alone(m: nn.Module, opt: torch.optim.Optimizer, rule: bool) -> Callable[[], None]:
    """``opt.step()`` (after the eager rule, with ``rule``) on the gradients computed
    once, given back to ``.grad`` before each call (HeavyBall clears them)."""
    groups = fg.group_by_module(m)
    named = list(m.named_parameters())
    grads = {n: p.grad for n, p in named}

    def step() -> None:
        for n, p in named:
            p.grad = grads[n]
        if rule:
            eager_rule_on_grads(m, groups)
        opt.step()

    return step


# name -> (torch class, keywords for both, fg factory, torch has a fused kernel)
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any], Any, bool]] = {
    "SGD": (torch.optim.SGD, dict(lr=LR, momentum=0.9, weight_decay=WD), fg.sgd, True),
    "Adam": (torch.optim.Adam, dict(lr=LR), fg.adam, True),
    "AdamW": (torch.optim.AdamW, dict(lr=LR, weight_decay=WD), fg.adamw, True),
    "Adagrad": (torch.optim.Adagrad, dict(lr=LR), fg.adagrad, True),
    "RMSprop": (torch.optim.RMSprop, dict(lr=LR, momentum=0.9), fg.rmsprop, False),
    "Adamax": (torch.optim.Adamax, dict(lr=LR), fg.adamax, False),
    "NAdam": (torch.optim.NAdam, dict(lr=LR), fg.nadam, False),
    "RAdam": (torch.optim.RAdam, dict(lr=LR), fg.radam, False),
    "Adadelta": (torch.optim.Adadelta, dict(lr=LR), fg.adadelta, False),
    "Rprop": (torch.optim.Rprop, dict(lr=LR), fg.rprop, False),
    "ASGD": (torch.optim.ASGD, dict(lr=LR), fg.asgd, False),
}


def optimizer_table(quick: bool, sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Each optimizer's update alone: fg.Optimizer / torch foreach (/ torch fused)."""
    out: dict[str, dict[str, float]] = {}
    for wname, (make, width, out_width, batch) in list(workloads(quick).items())[:2]:
        gen = torch.Generator().manual_seed(1)
        x, y = (
            torch.randn(batch, width, generator=gen),
            torch.randn(batch, out_width, generator=gen),
        )
        torch.manual_seed(0)
        base = make()
        print(f"\n{wname}: update alone, ratio to torch foreach")
        print(f"  {'optimizer':<10} {'foreach ms':>10} {'fg':>6} {'fused':>6}")
        for name, (cls, kw, factory, fused) in OPTIMIZERS.items():
            fns: dict[str, Callable[[], object]] = {}
            makers = {
                "foreach": lambda m, c=cls, k=kw: c(m.parameters(), foreach=True, **k),
                "fg": lambda m, f=factory, k=kw: fg.Optimizer(m, f(**k)),
            }
            if fused:
                makers["fused"] = lambda m, c=cls, k=kw: c(m.parameters(), fused=True, **k)
            for arm, opt_of in makers.items():
                m = copy.deepcopy(base)
                nn.functional.mse_loss(m(x), y).backward()
                fns[arm] = _update_alone(m, opt_of(m), False)
            t = interleaved(fns, 3 if quick else 9, 2 if quick else 10, warmup=3, sync=sync)
            ratio = {k: v / t["foreach"] for k, v in t.items()}
            out[f"{wname} {name}"] = {**t}
            fu = f"{ratio['fused']:6.2f}" if "fused" in ratio else f"{'-':>6}"
            print(f"  {name:<10} {t['foreach'] * 1e3:10.3f} {ratio['fg']:6.2f} {fu}")
    return out


def rule_floor(compile: bool, device: torch.device, sync: Callable[[], None]) -> dict:
    """The passes of an eager zero_fix against the fused AdamW update of one gradient
    (seconds per call, interleaved)."""
    gen = torch.Generator().manual_seed(0)
    n = 3132 * 3132
    g = torch.randn(n, generator=gen)
    g[torch.rand(n, generator=gen) < 0.02] = 0.0
    g = g.to(device)
    p, m, v = torch.randn_like(g), torch.randn_like(g), torch.rand_like(g)
    step = [torch.tensor(5.0, device=device)]
    mask, kept, half = torch.empty_like(g, dtype=torch.bool), torch.empty_like(g), g.new_tensor(0.5)

    def fused() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], step, lr=LR, beta1=0.9, beta2=0.999,
                            weight_decay=WD, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    def zero_fix(g: torch.Tensor, out: torch.Tensor) -> None:
        z = g == 0
        out.copy_(torch.where(z, torch.where(z.all(), 1.0, 0.5), g))

    fns: dict[str, Callable[[], object]] = {
        "fused AdamW update": fused,
        "eq(g, 0, out=mask)": lambda: torch.eq(g, 0, out=mask),
        "g.bool().all()": lambda: g.bool().all(),
        "count_nonzero(g)": lambda: torch.count_nonzero(g),
        "where(mask, 0.5, g, out=kept)": lambda: torch.where(mask, half, g, out=kept),
    }
    if compile:
        block = torch.compile(zero_fix, dynamic=True)
        fns["compiled zero_fix into kept"] = lambda: block(g, kept)
    t = interleaved(fns, 7, 5, sync=sync)
    print(f"one gradient of {n / 1e6:.1f}M float32 entries, 2% zeros; ratio to the fused update")
    for k, s in t.items():
        print(f"  {k:32s} {s * 1e3:7.2f} ms  {s / t['fused AdamW update']:5.2f}x")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled arms")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--optimizers", action="store_true", help="every optimizer, update alone")
    ap.add_argument("--rule-floor", action="store_true", help="the eager rule's passes alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} thread(s)")
    if args.rule_floor:
        floor = rule_floor(not args.no_compile, device, sync)
        write_json(args.out, "bench_drop_in_rule_floor", floor)
        return
    if args.optimizers:
        write_json(args.out, "bench_drop_in_optimizers", optimizer_table(args.quick, sync))
        return
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, (make, width, out_width, batch) in workloads(args.quick).items():
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, width, generator=gen).to(device)
        y = torch.randn(batch, out_width, generator=gen).to(device)
        t0 = time.perf_counter()
        steps, updates = arms(make, x, y, not args.no_compile)
        big = "29.4M" in name or "3.1M" in name
        reps, number = (3, 2) if args.quick else ((7, 2) if big else (9, 10))
        whole = interleaved(steps, reps, number, warmup=3, sync=sync)
        alone = interleaved(updates, reps, number, warmup=3, sync=sync)
        results[name] = {"step": whole, "update": alone}
        ref_s, ref_u = whole["torch-fused"], alone["torch-fused"]
        print(f"\n{name}  (torch-fused: step {ref_s * 1e3:.2f} ms, update {ref_u * 1e3:.2f} ms;"
              f" {time.perf_counter() - t0:.0f} s)")  # fmt: skip
        print(f"  {'arm':<20} {'whole step':>11} {'update alone':>13}")
        for arm in steps:
            u = f"{alone[arm] / ref_u:13.2f}" if arm in alone else f"{'-':>13}"
            print(f"  {arm:<20} {whole[arm] / ref_s:11.2f} {u}")
        for arm in ("fg-eager", "fg-eager+rule"):
            ref = "torch-fused+rule" if arm.endswith("rule") else "torch-fused"
            print(f"  {arm} / {ref}: step {whole[arm] / whole[ref]:.2f}, "
                  f"update {alone[arm] / alone[ref]:.2f}")  # fmt: skip
    suffix = "_quick" if args.quick else ""
    info = {"torch": torch.__version__, "device": str(device), "results": results}
    write_json(args.out, f"bench_drop_in{suffix}", info)


if __name__ == "__main__":
    main()
