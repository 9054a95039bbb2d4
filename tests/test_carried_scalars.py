"""The optimizers that carry 0-d values from step to step (NAdam's ``mu_product``,
ASGD's ``eta`` and ``mu``): equal to torch.optim's per-parameter state, value for value
(torch keeps them in its scalar dtype, float32 unless the default dtype is float64, and
so does funcgrad), ASGD's averaged parameters, a scheduler that moves lr before the
first step, and the default dtype read at ``init`` only."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from references import mlp, mlp_data

import funcgrad as fg

D = torch.float64
CASES = {
    "asgd": (fg.asgd, torch.optim.ASGD, dict(lr=0.05, lambd=0.1, alpha=0.5, t0=2)),
    "nadam": (fg.nadam, torch.optim.NAdam, dict(lr=0.01, momentum_decay=0.05)),
}
CARRIED = {"asgd": ("eta", "mu"), "nadam": ("mu_product",)}


def _steps(model, opt, sched, n):
    x, y = mlp_data(D)
    seen = []
    for _ in range(n):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
        seen.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return seen


@pytest.mark.parametrize("name", list(CASES))
def test_drop_in_under_a_scheduler_equals_torch_state_included(name):
    """fg.Optimizer and torch.optim under the same LambdaLR (which writes lr before the
    first step, so ASGD's first eta is the scheduled lr, not the built one): parameters
    after every step, and at the end the carried values (bit for bit) and ASGD's
    averaged parameters."""
    make, twin, kw = CASES[name]
    model = mlp(D)
    ref = copy.deepcopy(model)
    opt_t = twin(ref.parameters(), **kw)
    opt_f = fg.Optimizer(model, make(**kw))
    lam = lambda i: 0.5 + 0.25 * i  # noqa: E731
    want = _steps(ref, opt_t, torch.optim.lr_scheduler.LambdaLR(opt_t, lam), 6)
    got = _steps(model, opt_f, torch.optim.lr_scheduler.LambdaLR(opt_f, lam), 6)
    for w, g in zip(want, got, strict=True):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-12, atol=1e-14)
    state = opt_f.tx_state
    named = dict(ref.named_parameters())
    for f in CARRIED[name]:
        theirs = {float(opt_t.state[p][f]) for p in named.values()}
        assert {float(getattr(state, f))} == theirs, f
        assert getattr(state, f).dtype == opt_t.state[named["0.weight"]][f].dtype
    if name == "asgd":
        assert float(state.mu) < 1.0  # the average moved (t0=2)
        for k, p in named.items():
            torch.testing.assert_close(state.ax[k], opt_t.state[p]["ax"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(CASES))
def test_state_to_and_from_torch_carries_the_scalars(name):
    """state_to_torch writes the carried value into every parameter's state, in torch's
    scalar dtype; state_from_torch reads it back; parameters that disagree are refused."""
    make, twin, kw = CASES[name]
    model = mlp(D)
    params = fg.params(model)
    tx = make(**kw)
    step = fg.make_step(lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean(), tx)
    state = tx.init(params)
    x, y = mlp_data(D)
    for _ in range(4):
        params, state, _ = step(params, state, x, y)
    opt = twin(model.parameters(), **kw)
    named = dict(model.named_parameters())
    fg.state_to_torch(tx, state, opt, named)
    for f in CARRIED[name]:
        for p in named.values():
            assert opt.state[p][f].dtype == torch.float32
            assert float(opt.state[p][f]) == float(getattr(state, f))
    back = fg.state_from_torch(tx, opt, named)
    for f in CARRIED[name]:
        assert torch.equal(getattr(back, f), getattr(state, f))
    f = CARRIED[name][0]
    opt.state[named["0.bias"]][f] = opt.state[named["0.bias"]][f] * 0.5
    with pytest.raises(
        ValueError,
        match=re.escape("fg.state_from_torch: the optimizer's parameters hold different"),
    ):
        fg.state_from_torch(tx, opt, named)


@pytest.mark.parametrize("name", list(CASES))
def test_float64_default_dtype_keeps_them_in_float64_as_torch(name):
    """torch keeps its scalars in float64 when that is the default dtype; so does a state
    made then, and it goes on in float64 after the default is restored."""
    make, twin, kw = CASES[name]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = mlp(D)
        ref = copy.deepcopy(model)
        opt_t = twin(ref.parameters(), **kw)
        tx = make(**kw)
        state = tx.init(fg.params(model))
    finally:
        torch.set_default_dtype(old)
    params = fg.params(model)
    x, y = mlp_data(D)
    step = fg.make_step(lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean(), tx)
    torch.set_default_dtype(torch.float64)
    try:
        for _ in range(4):
            opt_t.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            opt_t.step()
    finally:
        torch.set_default_dtype(old)
    for _ in range(4):
        params, state, _ = step(params, state, x, y)
    for f in CARRIED[name]:
        assert getattr(state, f).dtype == torch.float64
        p = next(ref.parameters())
        assert float(getattr(state, f)) == float(opt_t.state[p][f])
    for k, p in ref.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-12, atol=1e-14)
