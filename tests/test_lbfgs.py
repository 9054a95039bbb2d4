"""fg.lbfgs beyond torch's test matrix (tests/test_optim_db.py runs every LBFGS config
there, both line-search settings, three ways): a real model with a history that
wraps, group keys written between steps, checkpoints, the compiled evaluation, and
the clear errors where L-BFGS does not apply."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from references import mlp, mlp_data

import funcgrad as fg

D = torch.float64
KW = dict(lr=0.5, max_iter=6, history_size=3, line_search_fn="strong_wolfe")


def _loss(model):
    x, y = mlp_data(D)
    return lambda p: ((fg.call(model, p, x) - y) ** 2).mean()


def _torch_steps(model, opt, n, between=None):
    x, y = mlp_data(D)
    losses = []
    for i in range(n):
        if between is not None:
            between(opt, i)

        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
    return losses


@pytest.mark.parametrize("search", [None, "strong_wolfe"])
def test_mlp_equals_torch_with_a_history_that_wraps(search):
    """history_size=3 over 5 steps of 6 iterations: the drop-in bit for bit, make_step
    (donated into the module) to 1e-12, and the returned first losses."""
    kw = dict(KW, line_search_fn=search)
    ref, model, fmodel = mlp(D), mlp(D), mlp(D)
    want = _torch_steps(ref, torch.optim.LBFGS(ref.parameters(), **kw), 5)
    got = _torch_steps(model, fg.Optimizer(model, fg.lbfgs(**kw)), 5)
    assert got == want
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    tx = fg.lbfgs(**kw)
    step = fg.make_step(_loss(fmodel), tx, donate=True)
    params = fg.params(fmodel)
    state = tx.init(params)
    firsts = []
    for _ in range(5):
        params, state, first = step(params, state)
        firsts.append(float(first))
    torch.testing.assert_close(torch.tensor(firsts), torch.tensor(want), rtol=1e-12, atol=0)
    for a, b in zip(fmodel.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert int(state.filled) == 3


def test_group_keys_written_between_steps_take_effect():
    """max_iter and lr written into param_groups between steps (torch reads them each
    step), and tolerance_grad through fg.set_hyperparams in a functional loop."""

    def between(opt, i):
        if i == 2:
            opt.param_groups[0]["max_iter"] = 2
            opt.param_groups[0]["lr"] = 0.25

    ref, model = mlp(D), mlp(D)
    want = _torch_steps(ref, torch.optim.LBFGS(ref.parameters(), **KW), 4, between)
    got = _torch_steps(model, fg.Optimizer(model, fg.lbfgs(**KW)), 4, between)
    assert got == want
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    model = mlp(D)
    tx = fg.lbfgs(**KW)
    step = fg.make_step(_loss(model), tx)
    start = {k: v.detach().clone() for k, v in fg.params(model).items()}
    p, s = dict(start), tx.init(start)
    for _ in range(4):
        p, s, _ = step(p, s)
    straight = p
    p, s = dict(start), tx.init(start)
    for _ in range(2):
        p, s, _ = step(p, s)
    fg.save_checkpoint(tmp_path / "c.pt", p, s)
    p, s, _ = fg.load_checkpoint(tmp_path / "c.pt", dict(start), tx)
    for _ in range(2):
        p, s, _ = step(p, s)
    for k in straight:
        assert torch.equal(p[k], straight[k])


def test_drop_in_state_dict_round_trip():
    ref, model = mlp(D), mlp(D)
    opt_ref = fg.Optimizer(ref, fg.lbfgs(**KW))
    _torch_steps(ref, opt_ref, 2)
    model.load_state_dict(ref.state_dict())
    opt = fg.Optimizer(model, fg.lbfgs(**KW))
    opt.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    assert _torch_steps(model, opt, 2) == _torch_steps(ref, opt_ref, 2)


def test_the_compiled_evaluation_equals_eager():
    """compile= compiles the loss-and-gradient evaluation (aot_eager: the same ops), the
    iterations stay eager: equal to the eager step."""
    model = mlp(D)
    tx = fg.lbfgs(**KW)
    params = {k: v.detach().clone() for k, v in fg.params(model).items()}
    eager = fg.make_step(_loss(model), tx)
    compiled = fg.make_step(_loss(model), tx, compile={"backend": "aot_eager"})
    p1, s1, l1 = eager(dict(params), tx.init(params))
    p2, s2, l2 = compiled(dict(params), tx.init(params))
    assert compiled.is_compiled and torch.equal(l1, l2)
    for k in p1:
        assert torch.equal(p1[k], p2[k])
    for a, b in zip(s1[:-1], s2[:-1], strict=True):
        assert torch.equal(a, b)


def test_where_lbfgs_does_not_apply_the_errors_say_so():
    model = mlp(D)
    params = fg.params(model)
    with pytest.raises(TypeError, match=re.escape("fg.lbfgs evaluates the loss itself")):
        fg.make_step(_loss(model), fg.chain(fg.clip_by_global_norm(1.0), fg.lbfgs()))(
            params, fg.chain(fg.clip_by_global_norm(1.0), fg.lbfgs()).init(params)
        )
    with pytest.raises(ValueError, match=re.escape("fg.lbfgs is a full-batch method")):
        fg.make_step(_loss(model), fg.lbfgs(), per_sample=fg.clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match=re.escape("fg.Optimizer.step: fg.lbfgs evaluates")):
        fg.Optimizer(model, fg.lbfgs()).step()
    with pytest.raises(ValueError, match=re.escape("fg.lbfgs doesn't support per-parameter")):
        fg.Optimizer(
            [{"params": [model[0].weight]}, {"params": [model[0].bias], "lr": 0.1}], fg.lbfgs()
        )
    with pytest.raises(TypeError, match=re.escape("fg.lbfgs.init: L-BFGS works on one flat")):
        fg.lbfgs().init({"a": torch.zeros(2), "b": torch.zeros(2, dtype=D)})
    with pytest.raises(ValueError, match=re.escape("fg.lbfgs: line_search_fn='wolfe'")):
        fg.lbfgs(line_search_fn="wolfe")


def test_migration_from_and_to_torch_lbfgs():
    """2 steps in torch.optim.LBFGS, 2 in funcgrad (make_step, donated), 2 back in
    torch: bit for bit the 6 steps of torch alone (the history wraps: history_size=3)."""
    ref, model = mlp(D), mlp(D)
    _torch_steps(ref, torch.optim.LBFGS(ref.parameters(), **KW), 6)
    opt = torch.optim.LBFGS(model.parameters(), **KW)
    _torch_steps(model, opt, 2)
    tx = fg.lbfgs(**KW)
    params = fg.params(model)
    state = fg.state_from_torch(tx, opt, params)
    assert int(state.count) == opt.state[next(model.parameters())]["n_iter"]
    step = fg.make_step(_loss(model), tx, donate=True)
    for _ in range(2):
        params, state, _ = step(params, state)
    back = torch.optim.LBFGS(model.parameters(), **KW)
    fg.state_to_torch(tx, state, back, dict(model.named_parameters()))
    _torch_steps(model, back, 2)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_maximize_is_minimizing_the_negative():
    """maximize=True (torch 2.14's keyword; its optim_db rows run on 2.14) on -f steps
    exactly as the default on f, and returns -f's first loss."""
    model = mlp(D)
    f = _loss(model)
    start = {k: v.detach().clone() for k, v in fg.params(model).items()}
    up = fg.lbfgs(**KW, maximize=True)
    a, _, la = fg.make_step(lambda p: -f(p), up)(dict(start), up.init(start))
    b, _, lb = fg.make_step(f, fg.lbfgs(**KW))(dict(start), fg.lbfgs(**KW).init(start))
    assert torch.equal(la, -lb)
    for k in a:
        assert torch.equal(a[k], b[k])
