"""Per-sample gradients and per-sample rules against Python loops over samples."""

from __future__ import annotations

import re

import pytest
import torch
from references import (
    MIXED_BATCH,
    assert_one_graph,
    assert_trees_close,
    make_mixed,
    mixed_loss,
    ref_zero_fix,
)
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg


def loop_grads(loss, params, *batch):
    """The reference: torch.func.grad on one sample at a time."""
    per = [
        torch.func.grad(loss)(params, *(b[i : i + 1] for b in batch))
        for i in range(batch[0].shape[0])
    ]
    return {k: torch.stack([g[k] for g in per]) for k in params}


def test_per_sample_grads_equal_a_python_loop():
    model = make_mixed()
    loss = mixed_loss(model)
    params = fg.params(model)
    got = fg.per_sample_grads(loss)(params, *MIXED_BATCH)
    want = loop_grads(loss, params, *MIXED_BATCH)
    assert "out.weight" not in got  # tied: one entry
    for k in want:
        assert got[k].shape == (7, *params[k].shape)
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


def test_per_sample_rule_then_mean_equals_loop():
    model = make_mixed()
    loss = mixed_loss(model)
    params = fg.params(model)
    groups = fg.group_by_module(model)
    tx = fg.adam(lr=1e-2)
    step = fg.make_step(loss, tx, per_sample=fg.per_group(fg.rules.zero_fix(), groups))
    new_params, _, got_loss = step(params, tx.init(params), *MIXED_BATCH)

    per = loop_grads(loss, params, *MIXED_BATCH)
    fixed = []
    for i in range(7):
        g = {k: v[i] for k, v in per.items()}
        for names in groups.values():
            g.update(ref_zero_fix({n: g[n] for n in names}))
        fixed.append(g)
    mean = {k: torch.stack([f[k] for f in fixed]).mean(0) for k in params}
    want, _ = tx.update(mean, tx.init(params), params)
    for k in params:
        torch.testing.assert_close(new_params[k], params[k] + want[k], rtol=1e-10, atol=1e-12)
    per_loss = torch.stack([loss(params, *(b[i : i + 1] for b in MIXED_BATCH)) for i in range(7)])
    torch.testing.assert_close(got_loss, per_loss.mean())


def test_dp_sgd_clip_and_noise_eager_equals_compiled_and_reference():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    tx = fg.chain(fg.add_noise(std=0.5 * 1.0 / 16, seed=7), fg.adam(lr=1e-2))
    ps = fg.clip_by_global_norm(1.0)
    params = fg.params(model)
    eager = fg.make_step(loss, tx, per_sample=ps)
    torch._dynamo.reset()
    counters.clear()
    compiled = fg.make_step(loss, tx, per_sample=ps, compile={"backend": "aot_eager"})
    pe, se = params, tx.init(params)
    pc, sc = params, tx.init(params)
    for _ in range(3):
        pe, se, le = eager(pe, se, x, y)
        pc, sc, lc = compiled(pc, sc, x, y)
        assert_trees_close((pc, sc, lc), (pe, se, le), rtol=1e-6, atol=1e-7)
    assert_one_graph()

    # Reference for one step: clip each sample by its global norm with
    # torch.nn.utils.clip_grad_norm_, average, add the same noise, Adam.
    per = loop_grads(loss, params, x, y)
    clipped = []
    for i in range(16):
        leaves = [nn.Parameter(torch.zeros_like(v)) for v in params.values()]
        for leaf, k in zip(leaves, params, strict=True):
            leaf.grad = per[k][i].clone()
        torch.nn.utils.clip_grad_norm_(leaves, 1.0)
        clipped.append({k: leaf.grad for k, leaf in zip(params, leaves, strict=True)})
    mean = {k: torch.stack([c[k] for c in clipped]).mean(0) for k in params}
    want, _ = tx.update(mean, tx.init(params), params)
    p1, _, _ = eager(params, tx.init(params), x, y)
    for k in params:
        torch.testing.assert_close(p1[k], params[k] + want[k], rtol=1e-5, atol=1e-7)


def test_per_sample_compiles_to_one_graph_with_inductor_equivalent_results():
    model = make_mixed().float()
    loss = mixed_loss(model)
    groups = fg.group_by_module(model)
    tx = fg.adam(lr=1e-2)
    ps = fg.per_group(fg.rules.zero_fix(), groups)
    torch._dynamo.reset()
    counters.clear()
    step = fg.make_step(loss, tx, per_sample=ps, compile={"backend": "aot_eager"})
    ref = fg.make_step(loss, tx, per_sample=ps)
    params = fg.params(model)
    a = step(params, tx.init(params), *MIXED_BATCH)
    b = ref(params, tx.init(params), *MIXED_BATCH)
    assert_trees_close(a, b, rtol=1e-6, atol=1e-7)
    assert_one_graph()


def test_per_sample_errors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    params = fg.params(model)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    with pytest.raises(
        RuntimeError, match=re.escape("BatchNorm in train mode: batch statistics mix the samples")
    ):
        fg.per_sample_grads(loss)(params, x, y)
    tx = fg.adam()
    step = fg.make_step(loss, tx, per_sample=fg.clip_by_global_norm(1.0))
    with pytest.raises(
        RuntimeError, match=re.escape("Call model.eval() before taking per-sample gradients")
    ):
        step(params, tx.init(params), x, y)
    model.eval()
    with pytest.raises(
        ValueError, match=re.escape("batch arguments have different batch sizes [8, 7]")
    ):
        fg.per_sample_grads(loss)(params, x, y[:7])
    with pytest.raises(
        ValueError, match=re.escape("batch arguments have different batch sizes [8, 7]")
    ):
        step(params, tx.init(params), x, y[:7])
    with pytest.raises(TypeError, match=re.escape("per_sample must be stateless")):
        fg.make_step(loss, tx, per_sample=fg.adam())(params, tx.init(params), x, y)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "batch argument 1 must be a tensor with a leading batch dimension, got float"
        ),
    ):
        fg.per_sample_grads(loss)(params, x, 1.0)
