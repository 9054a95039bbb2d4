"""Compiled with inductor, every optimizer and rule in bfloat16 and float16 equals its
eager run bit for bit (issue "Correct everywhere", point 4). Inductor keeps a fused
kernel's low-precision intermediates in float32 unless told to round where eager does
(``emulate_precision_casts``, which funcgrad's compiled steps set: see
``funcgrad.step._checks.eager_rounding``); without it a compiled Muon step on bfloat16
params was 36% of the update away from eager here (docs/compile-notes.md)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import funcgrad as fg
from funcgrad.step._checks import eager_rounding

HALF = [torch.bfloat16, torch.float16]


def optimizers() -> dict[str, fg.GradientTransformation]:
    return {
        "adam": fg.adam(lr=1e-2),
        "adamw": fg.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True),
        "sgd": fg.sgd(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
        "rmsprop": fg.rmsprop(lr=1e-2, momentum=0.5, centered=True),
        "adagrad": fg.adagrad(lr=1e-2, lr_decay=0.01),
        "adafactor": fg.adafactor(lr=1e-2),
        "lion": fg.lion(lr=1e-3, weight_decay=0.1),
        "muon": fg.muon(lr=2e-2),
        "adamax": fg.adamax(lr=1e-2, weight_decay=0.1),
        "radam": fg.radam(lr=1e-2, betas=(0.5, 0.7), decoupled_weight_decay=True, weight_decay=0.1),
        "adadelta": fg.adadelta(lr=0.5, weight_decay=0.1),
        "rprop": fg.rprop(lr=1e-2),
        "nadam": fg.nadam(lr=1e-2, weight_decay=0.1),
        "asgd": fg.asgd(lr=1e-2, t0=0, weight_decay=0.1),
        "sf_adamw": fg.schedule_free_adamw(lr=1e-2, weight_decay=0.1, warmup_steps=1),
    }


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_optimizer_and_the_rule_compiled_with_inductor_equal_eager(dtype):
    """Two updates of each optimizer after the seed rule, from gradients with exact
    zeros (both of the rule's branches fire), in one compiled function (one compile per
    dtype), against the same function run eagerly: bit for bit."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(12, 6, generator=g).to(dtype) for n in ("a.w", "b.w")}
    rule = fg.per_group(fg.rules.zero_fix(), fg.Groups({"a": ("a.w",), "b": ("b.w",)}))
    txs = {n: fg.chain(rule, tx) for n, tx in optimizers().items()}

    def steps(params, states, grads):
        out = {}
        for name, tx in txs.items():
            p, s = params, states[name]
            for gr in grads:
                u, s = tx.update(gr, s, p)
                p = fg.apply_updates(p, u)
            out[name] = (p, s)
        return out

    grads = []
    for i in range(2):
        gr = {n: torch.randn(12, 6, generator=g).to(dtype) for n in params}
        gr["a.w"] = torch.where(gr["a.w"] > 0.5, 0.0, gr["a.w"])  # some zeros
        if i == 1:
            gr["b.w"] = torch.zeros_like(gr["b.w"])  # a whole group of zeros
        grads.append(gr)
    states = {n: tx.init(params) for n, tx in txs.items()}
    want = steps(params, states, grads)
    got = torch.compile(steps, fullgraph=True, **eager_rounding({}))(params, states, grads)
    for name in txs:
        for k in params:
            assert torch.equal(got[name][0][k], want[name][0][k]), (name, k)
        for a, b in zip(
            torch.utils._pytree.tree_leaves(got[name][1]),
            torch.utils._pytree.tree_leaves(want[name][1]),
            strict=True,
        ):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_compiled_step_with_muon_and_the_rule_equals_eager(dtype):
    """fg.make_step(compile=True) with inductor (Muon on the matrices, AdamW on the
    rest, the seed rule): 3 steps bit for bit equal to the eager step."""
    torch.manual_seed(0)
    runs = []
    for compile in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)

        def labels(ps):
            return {n: "muon" if p.ndim == 2 else "adamw" for n, p in ps.items()}

        tx = fg.chain(
            fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)),
            fg.partition({"muon": fg.muon(lr=2e-2), "adamw": fg.adamw(lr=1e-2)}, labels),
        )

        def loss(p, x, y, model=model):
            return ((fg.call(model, p, x).float() - y) ** 2).mean()

        step = fg.make_step(loss, tx, compile=compile)
        params = fg.params(model)
        state = tx.init(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 4, generator=g)
            params, state, _ = step(params, state, x, y)
        runs.append(dict(params))
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_eager_rounding_options():
    assert eager_rounding({}) == {"options": {"emulate_precision_casts": True}}
    assert eager_rounding({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    mine = {"options": {"emulate_precision_casts": False}}
    assert eager_rounding(mine) == mine
    out = eager_rounding({"mode": "max-autotune-no-cudagraphs"})
    assert "mode" not in out and out["options"]["emulate_precision_casts"] is True
    assert out["options"]["max_autotune"] is True


def test_a_shared_inductor_cache_under_another_cpu_capability_warns():
    """torch's on-disk cache does not separate kernels by ATEN_CPU_CAPABILITY (a process
    reading the other's corrupts its heap: docs/compile-notes.md, "Torch bugs, with their
    repros")."""
    import warnings

    from funcgrad.step._checks import warn_shared_cache

    with pytest.warns(
        UserWarning,
        match=re.escape(
            "Give each capability its own cache: TORCHINDUCTOR_CACHE_DIR=/some/dir/inductor-avx2."
        ),
    ):
        warn_shared_cache({"ATEN_CPU_CAPABILITY": "avx2"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_shared_cache({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})
        warn_shared_cache({})
