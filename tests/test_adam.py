"""fg.adam / fg.adamw against torch.optim.Adam / AdamW, step by step."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from references import adam_grads_at, adam_params, adam_run_both, check_compiles

import funcgrad as fg

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}
OPTIONS = list(itertools.product([0.0, 0.1], [False, True], [False, True]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("wd", "amsgrad", "maximize"), OPTIONS)
@pytest.mark.parametrize("decoupled", [False, True])
def test_matches_torch_optim(dtype, wd, amsgrad, maximize, decoupled):
    kw = dict(
        lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, amsgrad=amsgrad, maximize=maximize
    )
    fg_opt, torch_opt = (fg.adamw, torch.optim.AdamW) if decoupled else (fg.adam, torch.optim.Adam)
    ours, theirs, state = adam_run_both(lambda: fg_opt(**kw), lambda ps: torch_opt(ps, **kw), dtype)
    assert state.count.dtype == torch.int64 and int(state.count) == 50
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **TOL[dtype])


def test_default_hyperparameters_match():
    ours, theirs, _ = adam_run_both(fg.adamw, lambda ps: torch.optim.AdamW(ps), torch.float64)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tensor_lr_and_schedule(dtype):
    lr = torch.tensor(0.02, dtype=torch.float64)  # a float32 0.02 is not 0.02
    ours, theirs, _ = adam_run_both(
        lambda: fg.adam(lr=lr), lambda ps: torch.optim.Adam(ps, lr=0.02), dtype
    )
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **TOL[dtype])

    # A schedule receives the number of steps already taken, like LambdaLR's epoch.
    def factor(c):
        return 1.0 / (1.0 + c)

    ours, theirs, _ = adam_run_both(
        lambda: fg.adam(lr=lambda count: 0.05 * factor(count)),
        lambda ps: torch.optim.Adam(ps, lr=0.05),
        dtype,
        schedule=factor,
    )
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **TOL[dtype])


def test_cosine_schedule_matches_torch_cosine_annealing():
    sched = fg.cosine_decay(0.1, 30)
    ours, theirs, _ = adam_run_both(
        lambda: fg.adam(lr=sched),
        lambda ps: torch.optim.Adam(ps, lr=0.1),
        torch.float64,
        steps=40,
        schedule=lambda c: float(fg.cosine_decay(1.0, 30)(torch.tensor(c))),
    )
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], **TOL[torch.float64])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_bfloat16_matches_torch_optim_adamw(amsgrad):
    """bfloat16 params: values against torch.optim.AdamW on the same bfloat16 params.

    Both round every intermediate to bfloat16 (8 bits of mantissa), in different
    places (torch fuses addcmul), so they agree to a few bfloat16 ulps, not bit for bit.
    """
    kw = dict(lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
    ours, theirs, state = adam_run_both(
        lambda: fg.adamw(**kw), lambda ps: torch.optim.AdamW(ps, **kw), torch.bfloat16, steps=10
    )
    for k in ours:
        assert ours[k].dtype == state.mu[k].dtype == torch.bfloat16
        torch.testing.assert_close(ours[k], theirs[k], rtol=2e-2, atol=2e-2)
    # The run moved the params by much more than the tolerance: the check is not empty.
    start = adam_params(torch.bfloat16)
    assert max((ours[k].float() - start[k].float()).abs().max() for k in ours) > 0.05


def test_update_compiles_once_over_steps():
    params = adam_params(torch.float32)
    lr = torch.tensor(0.01)
    for tx in (
        fg.adam(lr=lr, weight_decay=0.1, amsgrad=True),
        fg.adamw(lr=fg.cosine_decay(0.1, 5)),
    ):
        state = tx.init(params)
        arg_sets = []
        for step in range(3):
            grads = adam_grads_at(params, step)
            arg_sets.append((grads, state, params))
            _, state = tx.update(grads, state, params)
        check_compiles(tx.update, *arg_sets, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(lr=-1.0), "Invalid learning rate: -1.0"),
        (dict(lr=torch.tensor(-0.5)), "Invalid learning rate: -0.5"),
        (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0"),
        (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
        (dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    for factory in (fg.adam, fg.adamw):
        with pytest.raises(ValueError, match=re.escape(message)):
            factory(**kwargs)


def test_state_and_param_errors():
    tx = fg.adam()
    with pytest.raises(TypeError, match=re.escape("'n' has dtype torch.int64")):
        tx.init({"n": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(TypeError, match=re.escape("complex parameters are not supported")):
        tx.init({"z": torch.ones(2, dtype=torch.complex64)})


def _one_param_run(fg_opt, torch_opt, dtype, grads, kw, compile_backend=None):
    """Same param and gradient sequence through fg and torch.optim; both params."""
    p0 = torch.tensor([1.0, -0.5, 0.25], dtype=dtype)
    leaf = torch.nn.Parameter(p0.clone())
    opt = torch_opt([leaf], **kw)
    tx = fg_opt(**kw)
    params = {"w": p0.clone()}
    state = tx.init(params)

    def update(g, state, params):
        updates, state = tx.update(g, state, params)
        return fg.apply_updates(params, updates), state

    if compile_backend:
        torch._dynamo.reset()
        update = torch.compile(update, fullgraph=True, backend=compile_backend)
    for g in grads:
        leaf.grad = g.clone()
        opt.step()
        params, state = update({"w": g}, state, params)
    return params["w"], leaf.detach(), state


LOW_PRECISION_CASES = [
    (torch.float16, 300.0),  # g * g = 90000 > float16's max 65504
    (torch.float16, 0.5),  # ordinary gradients (small ones: the next test)
    (torch.bfloat16, 1e20),  # g * g = 1e40 > bfloat16's max 3.4e38
    (torch.bfloat16, 1e-30),
    (torch.float32, 1e20),  # the same in float32: torch keeps exp_avg_sq = 1e37
    (torch.float32, 1e-30),
]


@pytest.mark.parametrize(("dtype", "scale"), LOW_PRECISION_CASES)
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_large_and_tiny_gradients_match_torch_optim(dtype, scale, decoupled, backend):
    """torch.optim computes half precision in float32 (opmath) and orders (1 - b2) * g * g
    so that it does not overflow; fg.adam must move the parameter the same way."""
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(3, generator=g) * scale).to(dtype) for _ in range(5)]
    kw = dict(lr=0.01, weight_decay=0.1 if decoupled else 0.0, amsgrad=decoupled)
    fg_opt, torch_opt = (fg.adamw, torch.optim.AdamW) if decoupled else (fg.adam, torch.optim.Adam)
    ours, theirs, state = _one_param_run(fg_opt, torch_opt, dtype, grads, kw, backend)
    assert torch.isfinite(state.nu["w"]).all() and torch.isfinite(ours).all()
    assert ours.dtype == state.mu["w"].dtype == state.nu["w"].dtype == dtype
    if scale > 1:  # large gradients move it by about lr per step
        assert not torch.equal(ours, torch.tensor([1.0, -0.5, 0.25], dtype=dtype))
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


def test_float16_second_moment_underflow_stays_finite_where_torch_does_not():
    """|g| = 1e-4 in float16: (1 - b2) * g * g = 1e-11 underflows the stored second
    moment to 0. torch re-reads that 0 (and eps = 1e-8 is 0 in float16): inf/NaN.
    fg.adam uses this step's float32 moments: finite steps of about lr."""
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(3, generator=g) * 1e-4).to(torch.float16) for _ in range(5)]
    ours, theirs, _ = _one_param_run(fg.adam, torch.optim.Adam, torch.float16, grads, {"lr": 0.01})
    assert not torch.isfinite(theirs).all()
    start = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float16)
    assert torch.isfinite(ours).all()
    assert float((ours.float() - start.float()).abs().max()) < 5 * 0.01 * 6


def test_float16_gradient_of_300_moves_the_parameter_like_torch():
    """The reported case: one step at lr 0.01 with a float16 parameter and gradient 300."""
    grads = [torch.tensor([300.0], dtype=torch.float16)]
    p0 = torch.tensor([0.988], dtype=torch.float16)
    leaf = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adam([leaf], lr=0.01)
    leaf.grad = grads[0].clone()
    opt.step()
    tx = fg.adam(lr=0.01)
    params = {"w": p0.clone()}
    updates, state = tx.update({"w": grads[0]}, tx.init(params), params)
    moved = fg.apply_updates(params, updates)["w"]
    assert float(state.nu["w"]) == pytest.approx(90.0, rel=1e-3)  # not inf
    assert torch.equal(moved, leaf.detach())
