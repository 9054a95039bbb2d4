"""The main paths on the device named by ``FUNCGRAD_TEST_DEVICE`` (default: cpu).

CI runs this file on the CPU with everything else; ``tools/gpu.sh`` runs it with
``FUNCGRAD_TEST_DEVICE=cuda``. Every reference is computed on the same device: Adam
against ``torch.optim`` (float32, float16, bfloat16), the compiled (inductor) donated
step and ``compile="gradients"`` against the eager step, vmap per-sample gradients against a Python loop,
``fg.hooks.attach`` against the functional step, and a state round trip.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

DEVICE = torch.device(os.environ.get("FUNCGRAD_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("FUNCGRAD_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    ).to(DEVICE, dtype)


def batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g).to(DEVICE, dtype)
    x[:, :4] = -x[:, :4].abs()  # some ReLUs never fire: exact zeros in the gradients
    return x, torch.randint(0, 3, (12,), generator=g).to(DEVICE)


def ce(model: nn.Module):
    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x).float(), y)

    return loss


TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_matches_torch_optim_on_the_device(dtype, decoupled):
    torch.manual_seed(0)
    params = {
        "w": torch.randn(64, 32, device=DEVICE).to(dtype),
        "b": torch.randn(32, device=DEVICE).to(dtype),
    }
    leaves = {k: nn.Parameter(p.clone()) for k, p in params.items()}
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        leaves.values(), lr=1e-2, weight_decay=0.1
    )
    tx = (fg.adamw if decoupled else fg.adam)(lr=1e-2, weight_decay=0.1)
    state = tx.init(params)
    # Gradients of magnitude >= 0.1: a float16 second moment that underflows makes
    # torch.optim's update inf (documented in funcgrad/optim/_adam.py; tested on the CPU).
    # Adam (L2) adds weight_decay * p to the gradient before the moments: that is taken
    # back out of the gradient given, so the sum the moments see stays >= 0.1 too (a sum
    # near zero gave NaN in 3 of 2048 float16 entries on an H200, torch 2.11).
    # Half precision drifts apart by rounding over many steps: 3 steps there.
    for step in range(20 if dtype == torch.float32 else 3):
        g = torch.Generator().manual_seed(step)
        grads = {}
        for k, p in params.items():
            r = torch.randn(p.shape, generator=g)
            g_sum = r.sign() * (0.1 + r.abs())
            decay = 0.0 if decoupled else 0.1 * leaves[k].detach().float().cpu()
            grads[k] = (g_sum - decay).to(DEVICE, dtype)
        updates, state = tx.update(grads, state, params)
        params = fg.apply_updates(params, updates)
        for k, p in leaves.items():
            p.grad = grads[k].clone()
        opt.step()
    for k, p in params.items():
        assert p.device.type == DEVICE.type and p.dtype == dtype
        torch.testing.assert_close(p, leaves[k].detach(), **TOL[dtype])


def test_compiled_donated_step_equals_eager_on_the_device():
    """compile=True (one graph) and compile="gradients" (the forward and backward
    compiled, the update eager) against the eager step."""
    x, y = batch()
    runs = {}
    for compiled in (False, True, "gradients"):
        model = mlp()
        groups = fg.group_by_module(model)
        tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))
        params = fg.params(model)
        state = tx.init(params)
        counters.clear()
        step = fg.make_step(ce(model), tx, compile=compiled, donate=True)
        for _ in range(5):
            step(params, state, x, y)
        if compiled:
            assert counters["stats"]["unique_graphs"] == 1
        runs[compiled] = params
    for mode in (True, "gradients"):
        for k, p in runs[mode].items():
            assert p.device.type == DEVICE.type
            torch.testing.assert_close(p, runs[False][k], rtol=1e-5, atol=1e-6)


def test_per_sample_rule_under_vmap_equals_a_loop_on_the_device():
    model = mlp()
    x, y = batch()
    params = fg.params(model)
    rule = fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model))
    psg = fg.per_sample_grads(ce(model))(params, x, y)
    fixed = torch.func.vmap(lambda g: rule.update(g, fg.EmptyState())[0])(psg)
    for i in range(len(x)):
        g = torch.func.grad(ce(model))(params, x[i : i + 1], y[i : i + 1])
        want = rule.update(g, fg.EmptyState())[0]
        for k in want:
            torch.testing.assert_close(fixed[k][i], want[k], rtol=1e-5, atol=1e-6)


def test_hooks_attach_equals_the_functional_rule_on_the_device():
    x, y = batch()
    model = mlp()
    groups = fg.group_by_module(model)
    handle = fg.hooks.attach(model, fg.rules.zero_fix(), groups)
    nn.functional.cross_entropy(model(x), y).backward()
    handle.remove()
    ref = mlp()
    g = torch.func.grad(ce(ref))(fg.params(ref), x, y)
    want = fg.per_group(fg.rules.zero_fix(), groups).update(g, fg.EmptyState())[0]
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=1e-6)


def test_state_round_trip_keeps_the_device():
    params = fg.params(mlp())
    tx = fg.chain(fg.monitor(fg.Groups({"l0": ("0.weight",)})), fg.adam())
    _, state = tx.update(
        {k: torch.ones_like(p) for k, p in params.items()}, tx.init(params), params
    )
    buf = io.BytesIO()
    torch.save(fg.state_dict(state), buf)
    buf.seek(0)
    loaded = fg.load_state_dict(tx, params, torch.load(buf, weights_only=True))
    a = torch.utils._pytree.tree_leaves(state)
    b = torch.utils._pytree.tree_leaves(loaded)
    for s, t in zip(a, b, strict=True):
        assert t.device.type == DEVICE.type and torch.equal(s, t)
