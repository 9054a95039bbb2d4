"""make_step(compile="gradients"): the forward and backward compiled as one graph,
tx and the update eager. Against the eager step (and torch for train-mode
BatchNorm), donated, with per-sample gradients, failures, and its errors."""

from __future__ import annotations

import re

import optree
import pytest
import torch
from references import (
    MIXED_BATCH,
    assert_one_graph,
    assert_trees_close,
    dead_seed_model,
    make_mixed,
    mixed_loss,
    resnet_batches,
    resnet_funcgrad_run,
    resnet_model,
    resnet_reference,
    seed_loss,
)
from references import assert_matches_resnet as assert_matches_torch
from torch._dynamo.utils import counters

import funcgrad as fg

AOT = {"scope": "gradients", "backend": "aot_eager"}


def recording(tx: fg.GradientTransformation, seen: list[bool]) -> fg.GradientTransformation:
    """``tx``, noting for every update whether it runs inside torch.compile."""

    def update(grads, state, params=None):
        seen.append(torch.compiler.is_compiling())
        return tx.update(grads, state, params)

    return fg.GradientTransformation(tx.init, update)


def seed_tx(model: torch.nn.Module) -> fg.GradientTransformation:
    groups = fg.group_by_module(model)
    return fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))


def test_inductor_gradients_with_eager_update_equal_the_eager_step():
    torch._dynamo.reset()
    counters.clear()
    model, eager_model = dead_seed_model(), dead_seed_model()
    seen: list[bool] = []
    tx = recording(seed_tx(model), seen)
    step = fg.make_step(seed_loss(model), tx, compile="gradients", donate=True)
    etx = seed_tx(eager_model)
    estep = fg.make_step(seed_loss(eager_model), etx)
    params, eparams = fg.params(model), fg.params(eager_model)
    state, estate = tx.init(params), etx.init(eparams)
    mu = state.inner_states[1].mu
    x = torch.rand(3, 1, dtype=torch.float64)
    for i in range(20):
        out = step(params, state, x + 0.01 * i)
        eparams, estate, eloss = estep(eparams, estate, x + 0.01 * i)
        assert out[0] is params and out[1] is state  # donated: the same tensors back
        assert_trees_close(out, (eparams, estate, eloss), rtol=1e-10, atol=1e-12)
    assert_one_graph()  # the gradients: one graph for 20 steps
    assert seen and not any(seen)  # tx never ran inside the compiled graph
    assert state.inner_states[1].mu is mu and int(state.inner_states[1].count) == 20
    for n, p in model.named_parameters():  # the module sees every update
        assert p.data_ptr() == params[n].data_ptr()
    assert not torch.equal(params["fc1.bias"], torch.full((2,), -10.0, dtype=torch.float64))


def test_train_mode_batchnorm_equals_eager_torch():
    data = resnet_batches(6)
    ref = resnet_reference(resnet_model(), data)
    torch._dynamo.reset()
    counters.clear()
    model = resnet_model()
    params, buffers = resnet_funcgrad_run(model, data, compile=AOT, donate=True)
    assert_one_graph()
    assert_matches_torch(params, buffers, ref)
    assert int(model.block.bn1.num_batches_tracked) == 6  # donated into the module


def test_per_sample_rule_equals_the_eager_step():
    model = make_mixed()
    groups = fg.group_by_module(model)
    rule = fg.per_group(fg.rules.zero_fix(), groups)
    tx = fg.adam(lr=1e-2)
    torch._dynamo.reset()
    counters.clear()
    step = fg.make_step(mixed_loss(model), tx, per_sample=rule, compile=AOT)
    eager = fg.make_step(mixed_loss(model), tx, per_sample=rule)
    p, s = fg.params(model), tx.init(fg.params(model))
    ep, es = p, s
    for _ in range(3):
        p, s, loss = step(p, s, *MIXED_BATCH)
        ep, es, eloss = eager(ep, es, *MIXED_BATCH)
        assert_trees_close((p, s, loss), (ep, es, eloss), rtol=1e-10, atol=1e-12)
    assert_one_graph()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_equals_the_eager_step(dtype):
    """Half-precision params and gradients; Adam's moments in float32 math (opmath)."""
    model, eager_model = dead_seed_model(dtype), dead_seed_model(dtype)
    tx, etx = seed_tx(model), seed_tx(eager_model)
    step = fg.make_step(seed_loss(model), tx, compile=AOT, donate=True)
    estep = fg.make_step(seed_loss(eager_model), etx, donate=True)
    p, ep = fg.params(model), fg.params(eager_model)
    s, es = tx.init(p), etx.init(ep)
    x = torch.rand(3, 1, dtype=dtype)
    for _ in range(3):
        step(p, s, x)
        estep(ep, es, x)
    assert all(t.dtype == dtype for t in p.values())
    assert_trees_close((p, s), (ep, es), rtol=1e-3, atol=1e-3)
    assert not torch.equal(p["fc2.weight"], dead_seed_model(dtype).fc2.weight.detach())


def test_a_failing_update_changes_nothing_and_the_next_step_runs():
    model = dead_seed_model()
    calls = []

    def update(grads, state, params=None):
        calls.append(1)
        if len(calls) == 4:  # the meta-tensor check, then the third step
            raise RuntimeError("update failed")
        return inner.update(grads, state, params)

    inner = seed_tx(model)
    tx = fg.GradientTransformation(inner.init, update)
    step = fg.make_step(seed_loss(model), tx, compile=AOT, donate=True)
    params = fg.params(model)
    state = tx.init(params)
    x = torch.rand(3, 1, dtype=torch.float64)
    for _ in range(2):
        step(params, state, x)
    before = [t.clone() for t in (*params.values(), *optree.tree_leaves(state))]
    with pytest.raises(RuntimeError, match="update failed"):
        step(params, state, x)
    after = [*params.values(), *optree.tree_leaves(state)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    step(params, state, x)
    assert int(state.inner_states[1].count) == 3


def test_aux_comes_out_of_the_compiled_gradients_detached():
    model, eager_model = dead_seed_model(), dead_seed_model()

    def with_aux(m):
        def loss(p, x):
            out = fg.call(m, p, x)
            return torch.mean(torch.square(5.0 - out.sum())), {"out": out, "max": out.max()}

        return loss

    tx, etx = seed_tx(model), seed_tx(eager_model)
    step = fg.make_step(with_aux(model), tx, has_aux=True, compile=AOT, donate=True)
    estep = fg.make_step(with_aux(eager_model), etx, has_aux=True)
    p, ep = fg.params(model), fg.params(eager_model)
    s, es = tx.init(p), etx.init(ep)
    x = torch.rand(3, 1, dtype=torch.float64)
    for _ in range(3):
        *_, aux = step(p, s, x)
        ep, es, _, eaux = estep(ep, es, x)
        assert not aux["out"].requires_grad and not aux["max"].requires_grad
        assert_trees_close(aux, eaux, rtol=1e-12, atol=1e-12)
    assert_trees_close(p, ep, rtol=1e-10, atol=1e-12)


def test_scope_step_is_compile_true():
    """{"scope": "step", ...} is the whole step as one graph, as compile=True."""
    x = torch.rand(3, 1, dtype=torch.float64)
    runs = []
    for compile in ({"scope": "step", "backend": "aot_eager"}, {"backend": "aot_eager"}):
        torch._dynamo.reset()
        counters.clear()
        model = dead_seed_model()
        tx = seed_tx(model)
        step = fg.make_step(seed_loss(model), tx, compile=compile, donate=True)
        p = fg.params(model)
        s = tx.init(p)
        for _ in range(3):
            step(p, s, x)
        assert_one_graph()
        runs.append((p, s))
    assert_trees_close(runs[0], runs[1])  # bit for bit


@pytest.mark.parametrize("compile", ["grad", {"scope": "update", "backend": "aot_eager"}])
def test_unknown_compile_scope_is_an_error(compile):
    model = dead_seed_model()
    with pytest.raises(ValueError, match=re.escape("is not one of ('step', 'gradients', 'async')")):
        fg.make_step(seed_loss(model), seed_tx(model), compile=compile)
