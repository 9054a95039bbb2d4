"""fg.schedule_free_adamw / fg.schedule_free_sgd without the reference package (that
comparison: tests/integrations/test_schedule_free.py): fg.Optimizer's train()/eval()
modes and their errors, the starting point taken at the first step, the evaluation
point as a pure function, compiled."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from references import mlp, mlp_data

import funcgrad as fg

D = torch.float64


def _step(model, opt):
    x, y = mlp_data(D)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def test_step_in_eval_mode_is_refused_and_other_optimizers_ignore_the_mode():
    model = mlp(D)
    opt = fg.Optimizer(model, fg.schedule_free_adamw(lr=0.01))
    with pytest.raises(
        RuntimeError,
        match=re.escape("fg.Optimizer.step: a schedule-free optimizer is in eval mode"),
    ):
        _step(model, opt)
    opt.train()
    _step(model, opt)
    opt.eval()
    with pytest.raises(RuntimeError, match="eval mode"):
        _step(model, opt)
    plain = fg.Optimizer(mlp(D), fg.adamw(lr=0.01))  # train()/eval() change nothing
    before = {k: p.detach().clone() for k, p in plain._core.params().items()}
    plain.eval()
    plain.train()
    plain.eval()
    for k, p in plain._core.params().items():
        assert torch.equal(p, before[k])


def test_eval_and_train_move_the_parameters_and_back():
    """eval() puts the module at fg.schedule_free_eval's point; train() back at y (to
    rounding: two lerps)."""
    model = mlp(D)
    opt = fg.Optimizer(model, fg.schedule_free_sgd(lr=0.05, momentum=0.8))
    opt.train()
    for _ in range(3):
        _step(model, opt)
    y = {k: p.detach().clone() for k, p in model.named_parameters()}
    want = fg.schedule_free_eval(y, opt.tx_state)
    opt.eval()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[k], rtol=0, atol=0)
        assert not torch.equal(p.detach(), y[k])
    opt.train()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), y[k], rtol=1e-14, atol=1e-15)


def test_weights_loaded_after_the_optimizer_was_built_are_the_start():
    """z is the parameters of the first step (as the package takes them), not those at
    construction: loading weights between the two trains as if built after loading."""
    trained = mlp(D, seed=3)
    late = mlp(D)
    opt_late = fg.Optimizer(late, fg.schedule_free_adamw(lr=0.01))
    opt_late.train()  # before the first step: nothing moves
    late.load_state_dict(trained.state_dict())
    early = copy.deepcopy(trained)
    opt_early = fg.Optimizer(early, fg.schedule_free_adamw(lr=0.01))
    opt_early.train()
    for _ in range(3):
        _step(late, opt_late)
        _step(early, opt_early)
    for (k, a), b in zip(late.named_parameters(), early.parameters(), strict=True):
        assert torch.equal(a, b), k


def test_eval_point_is_pure_and_compiles():
    """fg.schedule_free_eval under torch.compile(fullgraph=True) equals eager; before
    the first step it is the parameters; a state without a schedule-free optimizer is
    refused."""
    model = mlp(D)
    tx = fg.chain(fg.clip_by_global_norm(1.0), fg.schedule_free_adamw(lr=0.01))
    params = {k: v.detach().clone() for k, v in fg.params(model).items()}
    state = tx.init(params)
    start = fg.schedule_free_eval(params, state)
    for k in params:
        assert torch.equal(start[k], params[k])
    x, y = mlp_data(D)
    step = fg.make_step(lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean(), tx)
    for _ in range(3):
        params, state, _ = step(params, state, x, y)
    compiled = torch.compile(fg.schedule_free_eval, fullgraph=True, backend="aot_eager")
    got, want = compiled(params, state), fg.schedule_free_eval(params, state)
    for k in want:
        assert torch.equal(got[k], want[k])
    with pytest.raises(
        TypeError,
        match=re.escape("fg.schedule_free_eval: the state holds no schedule-free optimizer state"),
    ):
        fg.schedule_free_eval(params, fg.adam().init(params))
