"""What the tests share: the models, data and independent references (plain Python
loops, eager torch, torch.optim) that funcgrad is compared against, and the checkers
that compare. Test modules import from here, never from one another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

TWIN_STEPS = 4
"""Steps of an optimizer against its torch.optim twin (tests/test_optimizers*.py)."""


class SeedModel(nn.Module):
    """The model of the original question: 1 -> 2 -> 3 -> 1 with ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 2)
        self.fc2 = nn.Linear(2, 3)
        self.fc3 = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def seed_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: fg.Params, x: torch.Tensor) -> torch.Tensor:
        return torch.mean(torch.square(5.0 - fg.call(model, params, x).sum()))

    return loss


def assert_trees_close(a: Any, b: Any, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Equal trees, entry by entry by path: a ``fg.Flat`` compares as the dict of its
    per-name views, so the flat and the per-tensor layouts compare with each other."""
    from funcgrad.core._tree import leaves_with_paths

    pa, pb = leaves_with_paths(a), leaves_with_paths(b)
    assert [p for p, _ in pa] == [p for p, _ in pb], f"structures differ: {pa} vs {pb}"
    for (_, x), (_, y) in zip(pa, pb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert x == y


def check_compiles(
    fn: Callable[..., Any],
    *arg_sets: tuple[Any, ...],
    backend: str = "aot_eager",
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[Any]:
    """Run ``fn`` on each argument tuple eagerly and compiled; equal results, one frame.

    Several argument sets with the same structure but other values prove that the
    compiled function neither graph-breaks nor recompiles on new values.
    """
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    outs = []
    for args in arg_sets:
        eager = fn(*args)
        comp = compiled(*args)
        assert_trees_close(comp, eager, rtol=rtol, atol=atol)
        outs.append(eager)
    assert_one_graph()
    return outs


def assert_one_graph() -> None:
    """One graph was captured and nothing recompiled.

    Counted with dynamo's own counters: ``unique_graphs`` counts graphs handed to the
    backend, so a recompile shows as a second graph. (A backend-side frame counter
    also counts dynamo's internal restart when it turns a 0-d tensor's float into a
    graph input, which is not a recompile.)
    """
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"expected one compiled graph, got {graphs}: {dict(counters['stats'])}"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def ref_zero_fix(group, all_zero=1.0, zero=0.5):
    """The seed's rule, written the obvious (host-branching) way."""
    if all(bool((t == 0).all()) for t in group.values()):
        return {k: torch.full_like(t, all_zero) for k, t in group.items()}
    out = {}
    for k, t in group.items():
        t = t.clone(memory_format=torch.contiguous_format)
        flat = t.view(-1)
        for i in range(flat.numel()):
            if flat[i].item() == 0.0:
                flat[i] = zero
        out[k] = t
    return out


def dead_seed_model(dtype=torch.float64) -> SeedModel:
    """The seed model with fc1 dead (all its grads are exactly zero) and fc2 partly
    dead, so both branches of the rule are taken every step."""
    torch.manual_seed(3)
    m = SeedModel().to(dtype)
    with torch.no_grad():
        m.fc1.bias.fill_(-10.0)  # ReLU(fc1(x)) == 0 for x in [0, 1): fc1 gets no gradient
        m.fc1.weight.fill_(0.5)
    return m


class PeakTracker(nn.Module):
    """A module that is not BatchNorm but updates a registered buffer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.peak.copy_(torch.maximum(self.peak, x.detach().abs().amax()))
        return x


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c, momentum=None)  # cumulative moving average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.block = Block(c)
        self.peak = PeakTracker()
        self.head = nn.Linear(c, classes)
        with torch.no_grad():
            self.head.bias.fill_(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.peak(self.block(self.stem(x))).mean((2, 3)))


def resnet_model(dtype=torch.float64) -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet().to(dtype)


def resnet_batches(n: int, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 1, 5, 5, generator=g, dtype=dtype), torch.randint(0, 3, (6,), generator=g))
        for _ in range(n)
    ]


def resnet_reference(model: TinyResNet, data) -> TinyResNet:
    """Eager torch in train mode: backward, the rule on each layer's .grad, Adam."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    groups = fg.group_by_module(model)
    named = dict(model.named_parameters())
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for names in groups.values():
            fixed = ref_zero_fix({n: named[n].grad for n in names})
            for n in names:
                named[n].grad = fixed[n]
        opt.step()
    return model


def resnet_funcgrad_run(model: TinyResNet, data, **kw):
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.01))

    def loss_fn(p, b, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)

    step = fg.make_step(loss_fn, tx, buffers=True, **kw)
    params, buffers = fg.params(model), fg.buffers(model)
    state = tx.init(params)
    for x, y in data:
        params, state, buffers, _ = step(params, state, buffers, x, y)
    return params, buffers


def assert_matches_resnet(params, buffers, ref: TinyResNet, tol: float = 1e-9) -> None:
    for k, v in params.items():
        torch.testing.assert_close(v, ref.get_parameter(k).detach(), rtol=tol, atol=tol)
    for k, v in buffers.items():
        want = ref.get_buffer(k)
        assert v.dtype == want.dtype, k
        torch.testing.assert_close(v, want, rtol=tol, atol=tol)


class Mixed(nn.Module):
    """Embedding + tied output head + BatchNorm (eval) + dead ReLU units."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        h = torch.relu(self.fc(self.emb(idx)) - 0.3)
        return self.out(self.bn(h))


def make_mixed():
    torch.manual_seed(0)
    m = Mixed().double()
    m.bn(torch.randn(16, 6, dtype=torch.float64))  # non-trivial running stats
    m.eval()
    return m


def mixed_loss(model):
    def loss(p, idx, target):
        return nn.functional.cross_entropy(fg.call(model, p, idx), target)

    return loss


MIXED_BATCH = (torch.tensor([1, 4, 4, 9, 0, 10, 3]), torch.tensor([2, 2, 7, 0, 5, 1, 10]))


ADAM_SHAPES = {"a.weight": (5, 3), "a.bias": (5,), "b.weight": (2, 5), "scalar": ()}


def adam_params(dtype):
    g = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
        for k, s in ADAM_SHAPES.items()
    }


def adam_grads_at(params, step):
    """Gradients that depend on the current params (so drift would compound) and
    include exact zeros and tiny values."""
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for k, p in params.items():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        gr = torch.sin(3 * p) + 0.1 * noise
        if p.dim():
            gr.view(-1)[0] = 0.0
        out[k] = gr
    return out


def adam_run_both(make_fg, make_torch, dtype, steps=50, schedule=None):
    params = adam_params(dtype)
    leaves = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = make_torch(list(leaves.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    tx = make_fg()
    state = tx.init(params)
    for step in range(steps):
        grads = adam_grads_at(params, step)
        tgrads = adam_grads_at({k: p.detach() for k, p in leaves.items()}, step)
        updates, state = tx.update(grads, state, params)
        params = fg.apply_updates(params, updates)
        for k, p in leaves.items():
            p.grad = tgrads[k]
        opt.step()
        if sched:
            sched.step()
    return params, {k: p.detach() for k, p in leaves.items()}, state


def mlp(dtype=torch.float64, bias=True, seed=0):
    """Matrices and vectors of several shapes (Muon: bias=False, a tall and a wide one)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 5, bias=bias), nn.Tanh(), nn.Linear(5, 4, bias=bias), nn.Tanh(),
        nn.Linear(4, 2, bias=bias),
    ).to(dtype)  # fmt: skip


def mlp_data(dtype=torch.float64, n=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randn(n, 2, generator=g, dtype=dtype)


def mse(model):
    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    return loss


def torch_run(model, opt, steps=TWIN_STEPS, scheduler=None, lrs=None):
    x, y = mlp_data(next(model.parameters()).dtype)
    for i in range(steps):
        if lrs is not None:
            for g in opt.param_groups:
                g["lr"] = lrs[i]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def clipped_loop(
    loss_fn: Callable[..., torch.Tensor], params: dict, x: torch.Tensor, y: torch.Tensor,
    max_norm: float,
) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """Per-sample clipping by a loop: each sample alone through plain autograd, its
    gradient clipped to ``max_norm`` as ``fg.rules.clip_norm`` does, then averaged.
    Returns the averaged gradients and the samples' norms."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(x.shape[0]):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        loss = loss_fn(leaves, x[i : i + 1], y[i : i + 1])
        gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        gs = [
            torch.zeros_like(p) if g is None else g
            for g, p in zip(gs, leaves.values(), strict=True)
        ]
        norm = torch.sqrt(sum(g.square().sum() for g in gs))
        norms.append(norm)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for k, g in zip(leaves, gs, strict=True):
            total[k] += coef * g / x.shape[0]
    return total, torch.stack(norms)
