"""Training-loop parts: gradient accumulation, schedules, weight-decay masks, each
against an independent reference (one big batch, closed forms and
torch.optim.lr_scheduler, torch.optim with param groups)."""

from __future__ import annotations

import math

import pytest
import torch
from references import (
    adam_params,
    adam_run_both,
    assert_one_graph,
    check_compiles,
    ref_zero_fix,
    resnet_batches,
    resnet_model,
)
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

# ------------------------------------------------------------------ accumulation


def dead_mlp() -> nn.Module:
    """An MLP whose first layer is dead (all-zero gradients): the rule matters."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    m = m.double()
    with torch.no_grad():
        m[0].bias.fill_(-100.0)
    return m


def mse(model):
    def loss(p, x, y):
        return (fg.call(model, p, x) - y).square().mean()

    return loss


def seed_chain(model) -> fg.GradientTransformation:
    groups = fg.group_by_module(model)
    return fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.01))


def data(n_steps: int, k: int, micro: int = 4):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_steps, k * micro, 4, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).sin()


def run_accumulated(model, k, n_steps, **kw):
    tx = fg.accumulate(seed_chain(model), every=k)
    step = fg.make_step(mse(model), tx, **kw)
    params = {n: p.clone() for n, p in fg.params(model).items()}
    state = tx.init(params)
    xs, ys = data(n_steps, k)
    for x, y in zip(xs, ys, strict=True):
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            before = {n: p.clone() for n, p in params.items()}
            params, state, _ = step(params, state, xm, ym)
            if i < k - 1:  # non-final micro-steps leave params bit-unchanged
                assert all(torch.equal(before[n], params[n]) for n in params)
    return params, state


def run_big_batch(model, k, n_steps):
    tx = seed_chain(model)
    step = fg.make_step(mse(model), tx)
    params = {n: p.clone() for n, p in fg.params(model).items()}
    state = tx.init(params)
    xs, ys = data(n_steps, k)
    for x, y in zip(xs, ys, strict=True):
        params, state, _ = step(params, state, x, y)
    return params, state


@pytest.mark.parametrize("k", [1, 3])
def test_accumulated_micro_steps_equal_one_big_batch_step(k):
    model = dead_mlp()
    got, state = run_accumulated(model, k, n_steps=5)
    want, want_state = run_big_batch(model, k, n_steps=5)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-9)
    assert int(state.inner.inner_states[1].count) == 5 == int(want_state.inner_states[1].count)
    assert int(state.mini_step) == 0
    assert not torch.equal(got["0.bias"], model[0].bias.detach())  # the rule moved it


@pytest.fixture(scope="module")
def compiled_accumulation():
    torch._dynamo.reset()
    counters.clear()
    model = dead_mlp()
    got, _ = run_accumulated(model, 3, n_steps=5, compile=True, donate=True)
    return got, counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def test_accumulation_compiles_to_one_graph_and_equals_the_big_batch(compiled_accumulation):
    got, graphs, breaks = compiled_accumulation
    assert graphs == 1 and not breaks  # 15 micro-steps, both branches: one graph
    want, _ = run_big_batch(dead_mlp(), 3, n_steps=5)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-9)


def test_accumulation_with_buffers_equals_eager_torch_accumulation():
    """Train-mode BatchNorm: running statistics move on every micro-batch, the
    optimizer once per k; against loss / k backward() k times, the rule, opt.step()."""
    k, steps = 2, 3
    micro = resnet_batches(k * steps)
    ref = resnet_model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    groups = fg.group_by_module(ref)
    named = dict(ref.named_parameters())
    for s in range(steps):
        opt.zero_grad()
        for x, y in micro[s * k : (s + 1) * k]:
            (nn.functional.cross_entropy(ref(x), y) / k).backward()
        for names in groups.values():
            fixed = ref_zero_fix({n: named[n].grad for n in names})
            for n in names:
                named[n].grad = fixed[n]
        opt.step()

    model = resnet_model()
    tx = fg.accumulate(fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.01)), k)

    def loss_fn(p, b, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)

    torch._dynamo.reset()
    counters.clear()
    step = fg.make_step(loss_fn, tx, buffers=True, compile={"backend": "aot_eager"}, donate=True)
    params, buffers = fg.params(model), fg.buffers(model)
    state = tx.init(params)
    for x, y in micro:
        params, state, buffers, _ = step(params, state, buffers, x, y)
    assert_one_graph()
    for n, p in params.items():
        torch.testing.assert_close(p, named[n].detach(), rtol=1e-9, atol=1e-9)
    for n, b in buffers.items():
        torch.testing.assert_close(b, ref.get_buffer(n), rtol=1e-9, atol=1e-9)
    assert int(buffers["block.bn1.num_batches_tracked"]) == k * steps


def test_accumulation_with_skip_if_nonfinite_skips_the_whole_step():
    """A NaN in one micro-batch makes the accumulated mean NaN: that update is
    skipped (params and Adam unchanged), and the next ones run as if it never was."""
    k = 2
    model = dead_mlp()
    tx = fg.accumulate(fg.skip_if_nonfinite(seed_chain(model)), every=k)
    step = fg.make_step(mse(model), tx)
    params = {n: p.clone() for n, p in fg.params(model).items()}
    state = tx.init(params)
    xs, ys = data(3, k)
    bad = ys[0].clone()
    bad[0] = float("nan")
    start = {n: p.clone() for n, p in params.items()}
    for xm, ym in zip(xs[0].chunk(k), bad.chunk(k), strict=True):
        params, state, _ = step(params, state, xm, ym)
    assert all(torch.equal(start[n], params[n]) for n in params)
    assert int(state.inner.skipped) == 1 and int(state.inner.inner.inner_states[1].count) == 0
    for x, y in zip(xs[1:], ys[1:], strict=True):
        for xm, ym in zip(x.chunk(k), y.chunk(k), strict=True):
            params, state, _ = step(params, state, xm, ym)
    # Reference: the big-batch run on the two good steps only.
    tx_ref = seed_chain(model)
    ref_step = fg.make_step(mse(model), tx_ref)
    ref_params = {n: p.clone() for n, p in fg.params(model).items()}
    ref_state = tx_ref.init(ref_params)
    for x, y in zip(xs[1:], ys[1:], strict=True):
        ref_params, ref_state, _ = ref_step(ref_params, ref_state, x, y)
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------- schedules


def optax_linear(c, init, end, steps):
    return init + (end - init) * min(max(c, 0), steps) / steps


def optax_cosine(c, init, steps, alpha):
    c = min(c, steps)
    return init * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * c / steps)) + alpha)


def test_schedules_equal_their_closed_forms():
    lin = fg.linear_schedule(0.1, 1.0, 7)
    wc = fg.warmup_cosine_decay(0.01, 1.0, warmup_steps=5, decay_steps=25, end_value=0.1)
    joined = fg.join_schedules([lambda c: c * 0 + 3.0, lin, fg.cosine_decay(2.0, 4)], [2, 6])
    for c in range(40):
        t = torch.tensor(float(c), dtype=torch.float64)
        assert float(lin(t)) == pytest.approx(optax_linear(c, 0.1, 1.0, 7), rel=1e-15)
        want_wc = optax_linear(c, 0.01, 1.0, 5) if c < 5 else optax_cosine(c - 5, 1.0, 20, 0.1)
        assert float(wc(t)) == pytest.approx(want_wc, rel=1e-14, abs=1e-15)
        want_j = (
            3.0
            if c < 2
            else optax_linear(c - 2, 0.1, 1.0, 7)
            if c < 6
            else optax_cosine(c - 6, 2.0, 4, 0.0)
        )
        assert float(joined(t)) == pytest.approx(want_j, rel=1e-14, abs=1e-15)
        assert wc(t).dtype == torch.float64


def test_warmup_cosine_equals_torch_sequential_lr():
    """LinearLR warmup + CosineAnnealingLR in a SequentialLR: the lr torch uses at each
    step equals the schedule at the same count (torch computes cosine recursively)."""
    peak, warmup, total, end = 0.1, 5, 30, 0.001
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    torch_sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=end),
        ],
        milestones=[warmup],
    )
    ours = fg.warmup_cosine_decay(0.01 * peak, peak, warmup, total, end_value=end)
    for c in range(total):
        want = opt.param_groups[0]["lr"]
        assert float(ours(torch.tensor(float(c), dtype=torch.float64))) == pytest.approx(
            want, rel=1e-9
        )
        opt.step()
        torch_sched.step()


def test_schedule_in_adam_matches_torch_and_never_recompiles():
    sched = fg.warmup_cosine_decay(0.0, 0.05, 3, 20, end_value=0.005)

    def factor(c):
        return float(sched(torch.tensor(float(c), dtype=torch.float64))) / 0.05

    ours, theirs, _ = adam_run_both(
        lambda: fg.adam(lr=sched),
        lambda ps: torch.optim.Adam(ps, lr=0.05),
        torch.float64,
        steps=25,
        schedule=factor,
    )
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-10, atol=1e-12)
    counts = [(torch.tensor(float(c), dtype=torch.float64),) for c in (0, 2, 3, 10, 25)]
    check_compiles(sched, *counts, rtol=1e-15, atol=1e-15)


# ------------------------------------------------------------------ decay masks


def no_decay_on_vectors(name, p):
    return p.ndim > 1


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("as_dict", [False, True])
def test_decay_mask_equals_torch_param_groups(decoupled, as_dict):
    params = adam_params(torch.float64)
    decay = {k: no_decay_on_vectors(k, p) for k, p in params.items()}
    mask = decay if as_dict else no_decay_on_vectors
    names = list(params)
    kw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    fg_opt, torch_opt = (fg.adamw, torch.optim.AdamW) if decoupled else (fg.adam, torch.optim.Adam)

    def make_torch(ps):
        return torch_opt(
            [
                {"params": [p for n, p in zip(names, ps, strict=True) if decay[n]]},
                {
                    "params": [p for n, p in zip(names, ps, strict=True) if not decay[n]],
                    "weight_decay": 0.0,
                },
            ],
            **kw,
        )

    ours, theirs, _ = adam_run_both(lambda: fg_opt(**kw, mask=mask), make_torch, torch.float64)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-10, atol=1e-12)
    # The mask mattered: without it the no-decay parameters end elsewhere.
    unmasked, _, _ = adam_run_both(lambda: fg_opt(**kw), make_torch, torch.float64)
    assert not torch.allclose(unmasked["a.bias"], ours["a.bias"], rtol=1e-6, atol=0)
