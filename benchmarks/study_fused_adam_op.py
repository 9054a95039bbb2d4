"""Study (#41 part 4): torch's fused Adam kernel as a ``torch.library.custom_op`` inside
the compiled step, against funcgrad's compiled step (inductor writes the Adam update).

The question: today the compiled MLP step's update is inductor's own loops over the
flat buffers (the rule fused into them). Would torch's hand-written fused Adam kernel
(``torch._fused_adam_``, what ``torch.optim.Adam(fused=True)`` runs), called from
inside the one graph through a custom op that declares what it writes
(``mutates_args``), with the rule's output feeding it, be faster, and is it equal to
``torch.optim.Adam(fused=True)`` bit for bit?

Variants, each one compiled step (inductor, ``fullgraph=True``) on the same MLP
(256-512-512-512-10, batch 64) and data, timed round-robin (median of repeats):

  fg-comp         funcgrad: ``fg.make_step(loss, chain(per_group(zero_fix), adam),
                  compile=True, donate=True)`` on ``fg.params(model)``
  op-fused        the same gradients (``torch.func.grad_and_value`` over
                  ``fg.call``, one tensor per parameter) and the same seed rule per
                  layer, written by hand, then the custom op ``funcgrad_study::adam_``
                  (``torch._foreach_add_`` on the step counts and ``torch._fused_adam_``
                  on the lists, in place): one graph
  hand-inductor   op-fused's step with the update written in torch operations (in
                  place, per tensor) for inductor to generate: the kernel's share
                  without funcgrad's own costs (checks, guards on its state tree)
  fwd+bwd         the compiled gradients alone (the floor)
  torch+fused     ``torch.compile(model)``, ``backward()``, ``Adam(fused=True)``, no
                  rule (PyTorch's own fast step)

Equality, checked before timing: the op-fused step's parameters and moments after 5
steps against the same gradients put through the rule eagerly and
``torch.optim.Adam(fused=True)`` (``torch.equal``), and the same for fg-comp (which is
equal to ``torch.optim.Adam`` up to rounding, not bit for bit: it computes in its own
order, tests/test_optimizers.py).

Run: python benchmarks/study_fused_adam_op.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fg-study-fused-"))

import torch
from torch import Tensor, nn

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import interleaved, mlp, per_name

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


WRITES = ("params", "exp_avgs", "exp_avg_sqs", "steps")


@torch.library.custom_op("funcgrad_study::adam_", mutates_args=WRITES)
def adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """``torch.optim.Adam(fused=True)``'s step on the lists, in place (its own calls)."""
    torch._foreach_add_(steps, 1)
    torch._fused_adam_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
        amsgrad=False, maximize=False,
    )  # fmt: skip


@adam_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps) -> None:
    return None


def adam_inductor_(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps) -> None:
    """The same update in torch operations, in place, for inductor to generate."""
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        t.add_(1)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        p.sub_(lr / bc1 * m / (v.sqrt() / bc2.sqrt() + eps))


def zero_fix(g: Tensor, all_zero: Tensor) -> Tensor:
    """The seed rule on one tensor, given whether its whole layer is zero."""
    return torch.where(all_zero, torch.ones_like(g), torch.where(g == 0, 0.5, g))


def ruled(grads: dict[str, Tensor], groups: fg.Groups) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for names in groups.values():
        all_zero = torch.stack([grads[n].eq(0).all() for n in names]).all()
        out.update({n: zero_fix(grads[n], all_zero) for n in names})
    return out


def op_step(m: nn.Module, device: str, give_grads: bool = False, update=adam_):
    """The hand-written compiled step with the custom op; returns (call, tensors, the
    groups). ``give_grads``: the step also returns the rule's output that fed the op."""
    groups = fg.group_by_module(m)
    p = per_name(m)
    names = list(p)
    ea = {n: torch.zeros_like(t) for n, t in p.items()}
    eas = {n: torch.zeros_like(t) for n, t in p.items()}
    steps = [torch.zeros((), device=device) for _ in names]

    def loss(params, x, y):
        return nn.functional.cross_entropy(fg.call(m, params, x), y)

    gv = torch.func.grad_and_value(loss)

    def step(params, ea, eas, steps, x, y):
        grads, value = gv(params, x, y)
        g = ruled(grads, groups)
        update(
            [params[n] for n in names], [g[n] for n in names],
            [ea[n] for n in names], [eas[n] for n in names], steps,
            LR, BETAS[0], BETAS[1], EPS,
        )  # fmt: skip
        return (value.detach(), g) if give_grads else value.detach()

    compiled = torch.compile(step, fullgraph=True)
    return compiled, (p, ea, eas, steps), groups


def check_equal(device: str) -> None:
    """op-fused (compiled) against Adam(fused=True) on a twin model, fed the rule's
    output that fed the op inside the graph (the step returns it)."""
    torch.manual_seed(0)
    m = mlp().to(device)
    twin = mlp().to(device)
    twin.load_state_dict(m.state_dict())
    compiled, (p, ea, eas, steps), _ = op_step(m, device, give_grads=True)
    opt = torch.optim.Adam(twin.parameters(), lr=LR, betas=BETAS, eps=EPS, fused=True)
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(5):
        x = torch.randn(64, 256, device=device, generator=g)
        x[:, :128] = 0  # some exact zeros in the first layer's gradients
        y = torch.randint(0, 10, (64,), device=device, generator=g)
        _, fixed = compiled(p, ea, eas, steps, x, y)
        for n, q in twin.named_parameters():
            q.grad = fixed[n]
        opt.step()
    same = all(torch.equal(p[n], q) for n, q in twin.named_parameters())
    st = opt.state
    same_m = all(
        torch.equal(ea[n], st[q]["exp_avg"]) and torch.equal(eas[n], st[q]["exp_avg_sq"])
        for n, q in twin.named_parameters()
    )
    print(f"op-fused (compiled) vs rule + Adam(fused=True), 5 steps: params bit for bit "
          f"{same}, moments bit for bit {same_m}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--number", type=int, default=20)
    a = ap.parse_args()
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    print("torch", torch.__version__, "device", dev)
    check_equal(dev)

    torch.manual_seed(0)
    x, y = torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)
    fns = {}
    first = {}

    m = mlp().to(dev)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam(lr=LR))
    params = fg.params(m)
    state = tx.init(params)

    def ce(mm):
        return lambda p, x, y: nn.functional.cross_entropy(fg.call(mm, p, x), y)

    step = fg.make_step(ce(m), tx, compile=True, donate=True)
    fns["fg-comp"] = lambda: step(params, state, x, y)

    m2 = mlp().to(dev)
    compiled, tensors, _ = op_step(m2, dev)
    fns["op-fused"] = lambda: compiled(*tensors, x, y)

    m5 = mlp().to(dev)
    compiled5, tensors5, _ = op_step(m5, dev, update=adam_inductor_)
    fns["hand-inductor"] = lambda: compiled5(*tensors5, x, y)

    m3 = mlp().to(dev)
    p3 = per_name(m3)
    fwdbwd = torch.compile(torch.func.grad_and_value(ce(m3)), fullgraph=True)
    fns["fwd+bwd"] = lambda: fwdbwd(p3, x, y)

    m4 = mlp().to(dev)
    fwd4 = torch.compile(m4)
    opt4 = torch.optim.Adam(m4.parameters(), lr=LR, fused=True)

    def torch_step() -> None:
        opt4.zero_grad()
        nn.functional.cross_entropy(fwd4(x), y).backward()
        opt4.step()

    fns["torch+fused"] = torch_step
    for k, f in fns.items():
        t = time.perf_counter()
        f()
        sync()
        first[k] = time.perf_counter() - t
    med = interleaved(fns, a.repeats, a.number, sync=sync)
    floor = med["fwd+bwd"]
    print(f"{'variant':<14} {'ms/step':>8} {'/fwd+bwd':>9} {'/fg-comp':>9} {'first call s':>13}")
    for k, v in med.items():
        print(f"{k:<14} {v * 1e3:8.3f} {v / floor:9.2f} {v / med['fg-comp']:9.2f} {first[k]:13.1f}")


if __name__ == "__main__":
    main()
