"""fg.Optimizer's eager step on torch's fused kernels (funcgrad/optim/_fused.py, issue
"The drop-in at fused speed"): Adam, AdamW, SGD and Adagrad, alone or after rules, per param
group, equal bit for bit to torch.optim's ``fused=True`` run with the same groups (the
same kernels), in every floating dtype; RMSprop, Adamax, NAdam, RAdam, Adadelta and Rprop
equal bit for bit to torch's ``foreach=True`` run (funcgrad/optim/_foreach.py) in
float32 and float64; every other case takes the general path, which the drop-in tests
hold against torch.optim's default."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import funcgrad as fg
from funcgrad.optim import _fused

STEPS = 6
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)
    ).to(dtype)


def data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 3, generator=g).to(dtype), torch.randn(10, 2, generator=g).to(dtype)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The groups stepped on the fused path, by optimizer name."""
    seen: list[str] = []
    real = _fused._step

    def spy(g: Any, *args: Any) -> Any:
        seen.append(g.tx.facts.optimizer.who)
        return real(g, *args)

    monkeypatch.setattr(_fused, "_step", spy)
    return seen


def run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dtype: torch.dtype,
    before: Callable[[int, nn.Module, Any], None] | None = None,
    sched: Any = None,
) -> dict[str, torch.Tensor]:
    x, y = data(dtype)
    for i in range(STEPS):
        if before is not None:
            before(i, model, opt)
        opt.zero_grad()
        (model(x) - y).float().pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal bit for bit, and trained (not both left where they started)."""
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())
    start = net(next(iter(want.values())).dtype).state_dict()
    if start.keys() == want.keys():
        assert any(not torch.equal(want[k], start[k]) for k in want)


def split(model: nn.Module, **second: Any) -> list[dict[str, Any]]:
    """Two param groups: weights, and biases with ``second``'s keys."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], **second},
    ]


CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], Any, dict[str, Any]]] = {
    # name: (torch class, torch kwargs, funcgrad optimizer, the biases' group keys)
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, fg.adamw, {"lr": 3e-2}),
    "adam-l2-amsgrad-maximize": (
        torch.optim.Adam,
        {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": True},
        fg.adam,
        {"weight_decay": 0.0, "betas": (0.8, 0.9)},
    ),
    "adam-decoupled": (
        torch.optim.Adam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
        fg.adam,
        {"eps": 1e-3},
    ),
    "sgd-momentum": (
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1},
        fg.sgd,
        {"nesterov": True, "dampening": 0.0, "momentum": 0.5},
    ),
    "sgd-plain": (torch.optim.SGD, {"lr": 1e-2, "maximize": True}, fg.sgd, {"lr": 0.1}),
    "adagrad": (
        torch.optim.Adagrad,
        {"lr": 1e-1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.2},
        fg.adagrad,
        {"lr": 0.05, "eps": 1e-3, "weight_decay": 0.0},
    ),
    "adagrad-maximize": (torch.optim.Adagrad, {"lr": 1e-1, "maximize": True}, fg.adagrad, {}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_groups_equal_torch_fused_bit_for_bit(case, dtype, fused_calls):
    cls, kwargs, fg_opt, second = CASES[case]
    a, b = net(dtype), net(dtype)
    want = run(a, cls(split(a, **second), **kwargs, fused=True), dtype)
    got = run(b, fg.Optimizer(split(b, **second), fg_opt(**kwargs)), dtype)
    assert_bitwise(got, want)
    assert len(fused_calls) == 2 * STEPS  # both groups, every step


FOREACH_CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], Any, dict[str, Any]]] = {
    # the optimizers without a torch fused kernel: torch's foreach implementation
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}, fg.rmsprop, {"lr": 3e-2, "alpha": 0.9}),
    "rmsprop-centered-momentum-l2-maximize": (
        torch.optim.RMSprop,
        {"lr": 1e-2, "momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True},
        fg.rmsprop,
        {"momentum": 0.5, "weight_decay": 0.0, "eps": 1e-3},
    ),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2, "weight_decay": 0.1}, fg.adamax, {"eps": 1e-3}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "weight_decay": 0.1}, fg.nadam, {"lr": 3e-2}),
    "nadam-decoupled": (
        torch.optim.NAdam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True},
        fg.nadam,
        {"momentum_decay": 1e-2},
    ),
    "radam": (
        torch.optim.RAdam,
        {"lr": 1e-2, "weight_decay": 0.1},
        fg.radam,
        {"betas": (0.8, 0.9)},
    ),
    "radam-decoupled": (
        torch.optim.RAdam,
        {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
        fg.radam,
        {"weight_decay": 0.0},
    ),
    "adadelta": (
        torch.optim.Adadelta,
        {"lr": 1.0, "weight_decay": 0.1, "maximize": True},
        fg.adadelta,
        {"rho": 0.5},
    ),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}, fg.rprop, {"lr": 3e-2, "etas": (0.3, 1.5)}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(FOREACH_CASES))
def test_groups_equal_torch_foreach_bit_for_bit(case, dtype, fused_calls):
    """Two param groups with their own values; NAdam's carried per-group mu_product
    equals torch's per-parameter ones after the run."""
    cls, kwargs, fg_opt, second = FOREACH_CASES[case]
    a, b = net(dtype), net(dtype)
    ta = cls(split(a, **second), **kwargs, foreach=True)
    tb = fg.Optimizer(split(b, **second), fg_opt(**kwargs))
    assert_bitwise(run(b, tb, dtype), run(a, ta, dtype))
    assert len(fused_calls) == 2 * STEPS  # both groups, every step
    fields = ("mu_product",) if case.startswith("nadam") else ()
    for group, inner in zip(ta.param_groups, tb.tx_state.inner_states, strict=True):
        for f in fields:
            for p in group["params"]:
                assert torch.equal(getattr(inner, f), ta.state[p][f]), (f, case)


ASGD_CASES = {
    "plain": {"lr": 0.1},
    "averaging-l2-maximize": {"lr": 0.1, "t0": 2, "weight_decay": 0.1, "maximize": True},
    "from-the-start": {"lr": 0.05, "t0": 0, "lambd": 0.01, "alpha": 0.5},
}


@pytest.mark.parametrize("case", list(ASGD_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_asgd_on_multi_tensor_ops_equals_the_general_path(case, dtype, fused_calls, monkeypatch):
    """ASGD's eager step on torch's multi-tensor ops (funcgrad/optim/_foreach.py,
    ``_asgd``) against the general path (funcgrad's kernel), two param groups: the
    parameters, the averaged parameters and the kept eta and mu, bit for bit."""

    def train(general: bool) -> tuple[dict[str, torch.Tensor], Any]:
        model = net(dtype)
        named = dict(model.named_parameters())
        groups = [
            {"params": [(n, named[n]) for n in ("0.weight", "0.bias")], "lr": 0.05},
            {"params": [(n, p) for n, p in named.items() if not n.startswith("0.")]},
        ]
        with monkeypatch.context() as m:
            if general:  # no fused plan: the optimizer's own kernel
                m.setattr(_fused, "plan", lambda *a, **k: None)
            opt = fg.Optimizer(groups, fg.asgd(**ASGD_CASES[case]))
            got = run(model, opt, dtype)
        return got, opt.tx_state

    fused, fused_state = train(False)
    assert fused_calls == ["fg.asgd"] * 2 * STEPS
    general, general_state = train(True)
    assert len(fused_calls) == 2 * STEPS
    assert_bitwise(fused, general)
    for a, b in zip(fused_state.inner_states, general_state.inner_states, strict=True):
        assert_bitwise(a.ax, b.ax)
        assert torch.equal(a.eta, b.eta) and torch.equal(a.mu, b.mu)
        assert a.eta.dtype == b.eta.dtype and int(a.count) == int(b.count) == STEPS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_foreach_optimizers_take_the_general_path(dtype, fused_calls):
    """torch's foreach RMSprop computes in the parameters' dtype, funcgrad in float32:
    half-precision parameters keep funcgrad's arithmetic."""
    model = net(dtype)
    start = copy.deepcopy(model)
    run(model, fg.Optimizer(model, fg.rmsprop(1e-2)), dtype)
    assert fused_calls == []
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters(), strict=True)
    )


def test_rmsprop_momentum_set_to_zero_takes_the_general_path(fused_calls):
    """RMSprop built with momentum whose group then writes momentum 0: torch skips the
    buffer, funcgrad's kernel updates it; that step runs funcgrad's own kernel."""
    model = net(torch.float64)

    def before(i: int, m: nn.Module, opt: Any) -> None:
        opt.param_groups[0]["momentum"] = 0.0 if i == 2 else 0.9

    run(model, fg.Optimizer(model, fg.rmsprop(1e-2, momentum=0.9)), torch.float64, before)
    assert fused_calls == ["fg.rmsprop"] * (STEPS - 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_one_cycle_with_momentum_on_the_fused_path(dtype, fused_calls):
    """OneCycleLR cycling lr and beta1, written to the groups every step."""
    a, b = net(dtype), net(dtype)
    ta = torch.optim.AdamW(split(a, lr=3e-2), 1e-2, weight_decay=0.1, fused=True)
    tb = fg.Optimizer(split(b, lr=3e-2), fg.adamw(1e-2, weight_decay=0.1))
    sa, sb = (
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=STEPS)
        for o in (ta, tb)
    )
    assert_bitwise(run(b, tb, dtype, sched=sb), run(a, ta, dtype, sched=sa))
    assert len(fused_calls) == 2 * STEPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_add_param_group_and_written_hyperparameters_on_the_fused_path(dtype, fused_calls):
    """The head frozen, then added as a new group mid-training (progressive
    unfreezing), while a hand-written schedule sets every group's lr, betas and
    weight_decay each step."""

    def build(model: nn.Module, make: Callable[..., Any]) -> Any:
        for p in model[4].parameters():
            p.requires_grad_(False)
        return make([p for p in model.parameters() if p.requires_grad])

    def before(i: int, model: nn.Module, opt: Any) -> None:
        if i == STEPS // 2:
            head = list(model[4].parameters())
            for p in head:
                p.requires_grad_(True)
            opt.add_param_group({"params": head, "lr": 1e-3, "weight_decay": 0.0})
        for j, g in enumerate(opt.param_groups):
            g["lr"] = 1e-2 / (1 + i + j)
            g["betas"] = (0.9 - 0.01 * i, 0.99)
            g["weight_decay"] = 0.1 * (i % 3)

    a, b = net(dtype), net(dtype)
    ta = build(a, lambda ps: torch.optim.AdamW(ps, 1e-2, weight_decay=0.1, fused=True))
    tb = build(b, lambda ps: fg.Optimizer(ps, fg.adamw(1e-2, weight_decay=0.1)))
    assert_bitwise(run(b, tb, dtype, before), run(a, ta, dtype, before))
    assert len(fused_calls) == STEPS + STEPS // 2


@pytest.mark.parametrize("kind", ["chain", "named_chain+monitor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_rules_in_front_then_fused_adamw(dtype, kind, fused_calls):
    """chain(per-layer zero_fix, adamw): the rule on the gradients, then the fused
    kernel; equal to torch's fused AdamW after the same rule written on ``.grad``.
    Gradients with exact zeros: a ReLU layer's, and a layer whose output is multiplied
    by 0 (an all-zero group, filled with 1.0). The rule runs by its host-read form
    (funcgrad/rules/_eager.py) and leaves ``.grad`` as backward wrote it."""
    rule = fg.rules.zero_fix()
    on_host, ruled = rule._eager, []
    rule._eager = lambda groups, scratch: ruled.append(len(groups)) or on_host(groups, scratch)

    def relu_net() -> nn.ModuleDict:
        torch.manual_seed(0)
        m = nn.ModuleDict({"a": nn.Linear(3, 8), "b": nn.Linear(8, 2), "dead": nn.Linear(3, 2)})
        return m.to(dtype)

    def loss(m: nn.ModuleDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = m["b"](torch.relu(m["a"](x))) + 0 * m["dead"](x)
        return (out - y).float().pow(2).mean()

    a, b = relu_net(), relu_net()
    ta = torch.optim.AdamW(a.parameters(), 1e-2, fused=True)
    groups = fg.group_by_module(b)
    if kind != "chain":  # the README's form: monitor, the rule, then the optimizer
        tx = fg.named_chain(
            ("monitor", fg.monitor(groups)),
            ("rule", fg.per_group(rule, groups)),
            ("adamw", fg.adamw(1e-2)),
        )
    else:
        tx = fg.chain(fg.per_group(rule, groups), fg.adamw(1e-2))
    tb = fg.Optimizer(b, tx)
    x, y = data(dtype)
    named = dict(a.named_parameters())
    for _ in range(STEPS):
        for m, opt in ((a, ta), (b, tb)):
            opt.zero_grad()
            loss(m, x, y).backward()
            if m is a:
                assert torch.equal(
                    named["dead.weight"].grad, torch.zeros_like(named["dead.weight"])
                )
                for names in fg.group_by_module(a).values():
                    fixed = rule({n: named[n].grad for n in names})
                    for n in names:
                        named[n].grad = fixed[n]
            opt.step()
        dead = b["dead"].weight.grad
        assert torch.equal(dead, torch.zeros_like(dead))  # .grad not written by the rule
    got = {n: p.detach() for n, p in b.named_parameters()}
    assert_bitwise(got, {n: p.detach() for n, p in a.named_parameters()})
    assert len(fused_calls) == STEPS
    assert ruled == [3] * STEPS
    if kind != "chain":  # the monitor's state advanced on the fused path too
        assert bool(tb.tx_state["monitor"].stats["dead"]["all_zero"])
        assert int(tb.tx_state["adamw"].count) == STEPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rule_results_borrowed_across_steps(dtype, fused_calls):
    """Gradients large enough that the rule's results and masks are borrowed from the
    optimizer's scratch and lent again each step (a ReLU layer's zeros, an all-zero
    layer): every step equal, bit for bit, to torch's fused AdamW after the rule on
    ``.grad``, and so is a second optimizer sharing the rule, stepped in between (each
    optimizer lends its own buffers); and a transformation after the rule that keeps
    its input in its state (the ruled gradient) keeps it unchanged: that buffer is
    never lent again."""
    rule = fg.rules.zero_fix()
    held: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def keep_last() -> fg.GradientTransformation:
        def init(params: Any) -> Any:
            return {n: torch.zeros_like(p) for n, p in params.items()}

        def update(grads: Any, state: Any, params: Any = None) -> Any:
            held.append((dict(grads), {n: g.clone() for n, g in grads.items()}))
            return grads, dict(grads)  # the ruled gradients themselves, not copies

        return fg.GradientTransformation(init, update)

    def wide() -> nn.ModuleDict:
        torch.manual_seed(0)
        m = nn.ModuleDict({"a": nn.Linear(200, 200), "dead": nn.Linear(200, 200)})
        return m.to(dtype)

    def loss(m: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(m["a"](x) - 0.5)
        return h.pow(2).mean() + (0 * m["dead"](x)).sum()

    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(2)).to(dtype)
    for keep in (False, True):
        held.clear()
        a, b, c = wide(), wide(), wide()
        ta = torch.optim.AdamW(a.parameters(), 1e-2, fused=True)
        rules_tx = [fg.per_group(rule, fg.group_by_module(b))]
        tb = fg.Optimizer(b, fg.chain(*rules_tx, *([keep_last()] if keep else []), fg.adamw(1e-2)))
        tc = fg.Optimizer(c, fg.chain(fg.per_group(rule, fg.group_by_module(c)), fg.adamw(1e-2)))
        named = dict(a.named_parameters())
        for _ in range(3):
            for m, opt in ((a, ta), (b, tb), (c, tc)):
                opt.zero_grad()
                loss(m, x).backward()
                if m is a:
                    assert (named["a.weight"].grad == 0).any()
                    for names in fg.group_by_module(a).values():
                        fixed = rule({n: named[n].grad for n in names})
                        for n in names:
                            named[n].grad = fixed[n]
                opt.step()
            want = {n: p.detach() for n, p in a.named_parameters()}
            assert_bitwise({n: p.detach() for n, p in b.named_parameters()}, want)
            assert_bitwise({n: p.detach() for n, p in c.named_parameters()}, want)
        if keep:  # each step's ruled gradients are still what they were
            assert len(held) == 3
            for kept, then in held:
                assert_bitwise(kept, then)
            assert (held[0][1]["a.weight"] == 0.5).any()
            assert torch.equal(held[0][1]["dead.weight"], torch.ones_like(held[0][1]["a.weight"]))
    assert len(fused_calls) == 12


def test_decay_mask_splits_the_kernel_calls(fused_calls):
    """A mask (decay on matrices only) is torch's decay / no-decay groups."""
    a, b = net(torch.float32), net(torch.float32)
    groups = [
        {"params": [p for p in a.parameters() if p.ndim == 2]},
        {"params": [p for p in a.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    want = run(a, torch.optim.AdamW(groups, 1e-2, weight_decay=0.3, fused=True), torch.float32)
    tx = fg.adamw(1e-2, weight_decay=0.3, mask=lambda n, p: p.ndim == 2)
    assert_bitwise(run(b, fg.Optimizer(b, tx), torch.float32), want)
    assert fused_calls == ["fg.adamw"] * STEPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_decay_mask_on_the_foreach_path_with_a_carried_scalar(dtype, fused_calls):
    """NAdam with a decay mask: one torch call per decay setting within the group, each
    starting from the state's mu_product (torch keeps one per parameter, each advanced
    once a step); equal to torch's decay / no-decay groups."""
    a, b = net(dtype), net(dtype)
    groups = [
        {"params": [p for p in a.parameters() if p.ndim == 2]},
        {"params": [p for p in a.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    ta = torch.optim.NAdam(groups, 1e-2, weight_decay=0.3, foreach=True)
    want = run(a, ta, dtype)
    tx = fg.nadam(1e-2, weight_decay=0.3, mask=lambda n, p: p.ndim == 2)
    tb = fg.Optimizer(b, tx)
    assert_bitwise(run(b, tb, dtype), want)
    assert fused_calls == ["fg.nadam"] * STEPS
    p = next(iter(a.parameters()))
    assert torch.equal(tb.tx_state.mu_product, ta.state[p]["mu_product"])


def test_two_optimizers_interleaved(fused_calls):
    """Two fg.Optimizers stepped in turn share nothing: each equals its own torch run."""
    dt = torch.float64
    models = [net(dt) for _ in range(4)]
    for m, scale in zip(models[2:], (2.0, 3.0), strict=True):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)
    for m in models[:2]:
        with torch.no_grad():
            for p, q in zip(m.parameters(), models[2 + models.index(m)].parameters(), strict=True):
                p.copy_(q)
    ours = [fg.Optimizer(models[0], fg.adamw(1e-2)), fg.Optimizer(models[1], fg.sgd(0.1, 0.9))]
    torchs = [
        torch.optim.AdamW(models[2].parameters(), 1e-2, fused=True),
        torch.optim.SGD(models[3].parameters(), 0.1, 0.9, fused=True),
    ]
    x, y = data(dt)
    for _ in range(STEPS):
        for m, o in zip(models, ours + torchs, strict=True):
            o.zero_grad()
            (m(x) - y).pow(2).mean().backward()
            o.step()
    for i in range(2):
        assert_bitwise(dict(models[i].named_parameters()), dict(models[2 + i].named_parameters()))
    assert len(fused_calls) == 2 * STEPS


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: fg.adam(1e-2, eps_root=1e-8), id="eps_root"),
        pytest.param(lambda: fg.lion(1e-3), id="lion"),
        pytest.param(lambda: fg.chain(fg.adam(1e-2), fg.identity()), id="optimizer-not-last"),
    ],
)
def test_the_rest_takes_the_general_path(make, fused_calls):
    """What the fused kernels cannot compute runs as before: still a step."""
    model = net(torch.float64)
    start = copy.deepcopy(model)
    run(model, fg.Optimizer(model, make()), torch.float64)
    assert fused_calls == []
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters(), strict=True)
    )


def test_compiled_step_is_traced_not_fused(fused_calls):
    """Under torch.compile(opt.step) the step is traced (the general path), and equal to
    the eager fused run to float64 rounding."""
    a, b = net(torch.float64), net(torch.float64)
    want = run(a, fg.Optimizer(a, fg.adamw(1e-2)), torch.float64)
    assert len(fused_calls) == STEPS
    opt = fg.Optimizer(b, fg.adamw(1e-2))
    opt.step = torch.compile(opt.step, backend="aot_eager")  # type: ignore[method-assign]
    got = run(b, opt, torch.float64)
    assert len(fused_calls) == STEPS
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_step_with_inductor_writes_the_state_in_place(dtype):
    """torch.compile(opt.step) with inductor, AdamW with the seed rule in front: the
    eager optimizer's values (float64 1e-12, float32 1e-5), one graph over the steps,
    the state's tensors the same objects after every step (written in place, as the
    fused kernels do; a new state each step made the compiled update 7.8x torch's fused
    AdamW at 29.4M parameters), and its state_dict resumes eagerly."""
    from torch._dynamo.utils import counters

    def opt_for(m: nn.Module) -> fg.Optimizer:
        rule = fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m))
        return fg.Optimizer(m, fg.chain(rule, fg.adamw(1e-2, weight_decay=0.1)))

    a, b = net(dtype), net(dtype)
    eager = opt_for(a)
    want = run(a, eager, dtype)
    opt = opt_for(b)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(opt.step)
    held: list[list[int]] = []

    def step() -> None:
        compiled()
        held.append([id(t) for t in torch.utils._pytree.tree_leaves(opt.tx_state)])

    opt.step = step  # type: ignore[method-assign]
    got = run(b, opt, dtype)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert all(ids == held[0] for ids in held[1:])  # the same tensors: written in place
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol)
    resumed = opt_for(b)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    after, more = run(b, resumed, dtype), run(a, eager, dtype)
    for k in more:
        torch.testing.assert_close(after[k], more[k], **tol)


def test_state_dict_after_fused_steps_resumes(fused_calls):
    """The state the fused kernels write in place is the state a checkpoint saves."""
    dt = torch.float32
    a, b = net(dt), net(dt)
    oa = fg.Optimizer(a, fg.adamw(1e-2))
    run(a, oa, dt)
    b.load_state_dict(a.state_dict())
    ob = fg.Optimizer(b, fg.adamw(1e-2))
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert_bitwise(run(b, ob, dt), run(a, oa, dt))
    assert len(fused_calls) == 3 * STEPS


def test_the_traced_state_is_written_in_place_only_where_that_keeps_the_values():
    """torch_optim._core.written_into (what a traced opt.step does with the new state): the
    old tensors take the new values, unless one old tensor sits at two places, an old
    tensor is a parameter, or the structure changed; then the new state is the state
    and nothing old is written."""
    from funcgrad.torch_optim._core import written_into as _written_into

    p = torch.zeros(2)
    a, b = torch.zeros(2), torch.zeros(3)
    new = {"m": torch.ones(2), "v": torch.full((3,), 2.0), "n": 5}
    old = {"m": a, "v": b, "n": 5}
    assert _written_into(old, new, [p]) is old
    assert torch.equal(a, new["m"]) and torch.equal(b, new["v"])
    twin = {"m": torch.ones(2), "v": torch.full((2,), 2.0), "n": 5}
    for bad_old, given in (
        ({"m": a, "v": a, "n": 5}, twin),  # one tensor at two places
        ({"m": p, "v": torch.zeros(3), "n": 5}, new),  # a parameter
        ({"m": a, "n": 5}, new),  # another structure
        ({"m": a, "v": torch.zeros(3, dtype=torch.float64), "n": 5}, new),  # a dtype
        ({"m": a, "v": torch.zeros(3), "n": 6}, new),  # a Python value changed
    ):
        before = [t.clone() for t in bad_old.values() if isinstance(t, torch.Tensor)]
        assert _written_into(bad_old, given, [p]) is given
        after = [t for t in bad_old.values() if isinstance(t, torch.Tensor)]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
