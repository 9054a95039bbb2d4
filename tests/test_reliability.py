"""Checkpoints, migration from torch.optim, non-finite steps and the hooks bridge."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from references import SeedModel, assert_trees_close, check_compiles, ref_zero_fix, seed_loss
from torch import nn
from workers.resume_worker import run, setup

import funcgrad as fg

HERE = Path(__file__).parent


def test_resume_in_a_fresh_process_is_bit_for_bit(tmp_path):
    model, tx, step = setup()
    params = fg.params(model)
    want_params, want_state = run(params, tx.init(params), step, 0, 8)
    assert int(want_state.inner_states[3].skipped) == 1  # the NaN step was skipped

    ckpt = str(tmp_path / "ckpt.pt")
    for args in (["save", "5", ckpt], ["resume", "8", ckpt]):
        subprocess.run(
            [sys.executable, str(HERE / "workers" / "resume_worker.py"), *args],
            check=True,
            timeout=300,
        )
    got = torch.load(ckpt + ".final", weights_only=True)
    for k, v in want_params.items():
        assert torch.equal(got["params"][k], v), k
    want_sd = fg.state_dict(want_state)
    assert_trees_close(got["state"], want_sd)  # rtol=atol=0: exact


def test_load_state_dict_names_the_mismatch():
    p = {"a.weight": torch.zeros(2, 2), "a.bias": torch.zeros(2)}
    adam = fg.adam()
    sd = fg.state_dict(adam.init(p))
    with pytest.raises(TypeError, match=re.escape("state should be a ChainState, found AdamState")):
        fg.load_state_dict(fg.chain(fg.adam()), p, sd)
    with pytest.raises(
        KeyError,
        match=re.escape(
            "missing state.nu_max['a.weight'], state.nu_max['a.bias']; unexpected (none)"
        ),
    ):
        fg.load_state_dict(fg.adam(amsgrad=True), p, sd)
    other = {"a.weight": torch.zeros(3, 2), "a.bias": torch.zeros(2)}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "state.mu['a.weight'] has shape (2, 2) and dtype torch.float32 in the checkpoint, but tx.init(params) makes (3, 2) torch.float32"
        ),
    ):
        fg.load_state_dict(adam, other, sd)
    with pytest.raises(
        KeyError,
        match=re.escape("missing (none); unexpected state.mu['a.bias'], state.nu['a.bias']"),
    ):
        fg.load_state_dict(adam, {"a.weight": p["a.weight"]}, sd)


def _torch_then_fg(opt_cls, fg_fn, kw, k=10, n=25):
    """torch.optim for k steps, convert, funcgrad for the rest; vs torch.optim all along."""
    torch.manual_seed(0)
    model = SeedModel().double()
    ref = SeedModel().double()
    ref.load_state_dict(model.state_dict())
    x = torch.rand(3, 1, dtype=torch.float64)
    opt = opt_cls(model.parameters(), **kw)
    ropt = opt_cls(ref.parameters(), **kw)
    for m, o in ((model, opt), (ref, ropt)):
        for _ in range(k):
            o.zero_grad()
            seed_loss(m)(dict(m.named_parameters()), x).backward()
            o.step()
    for _ in range(n - k):
        ropt.zero_grad()
        seed_loss(ref)(dict(ref.named_parameters()), x).backward()
        ropt.step()
    tx = fg_fn(**kw)
    state = fg.state_from_torch(tx, opt, dict(model.named_parameters()))
    assert int(state.count) == k
    step = fg.make_step(seed_loss(model), tx, donate=True)
    params = fg.params(model)
    for _ in range(n - k):
        params, state, _ = step(params, state, x)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-10, atol=1e-12)
    # And back: the funcgrad state continues in torch.optim like in funcgrad.
    back = opt_cls(model.parameters(), **kw)
    fg.state_to_torch(tx, state, back, dict(model.named_parameters()))
    fstate = state
    fparams = {k2: v.clone() for k2, v in params.items()}
    for _ in range(5):
        back.zero_grad()
        seed_loss(model)(dict(model.named_parameters()), x).backward()
        back.step()
        fparams, fstate, _ = fg.make_step(seed_loss(model), tx)(fparams, fstate, x)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), fparams[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("opt_cls", "fg_fn", "kw"),
    [
        (torch.optim.Adam, fg.adam, dict(lr=0.01)),
        (torch.optim.Adam, fg.adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
        (torch.optim.AdamW, fg.adamw, dict(lr=0.01, amsgrad=True, betas=(0.8, 0.95))),
    ],
)
def test_migration_from_and_to_torch_optim(opt_cls, fg_fn, kw):
    _torch_then_fg(opt_cls, fg_fn, kw)


def test_migration_errors():
    """A parameter that never had a gradient has no torch state (torch skips it): it is
    at step 0 beside the others' step 1, which one funcgrad counter cannot hold (it was
    taken as step 1, and its first update then differed from torch's); amsgrad on one
    side only is refused both ways."""
    model = SeedModel()
    opt = torch.optim.Adam(model.parameters())
    opt.zero_grad()
    model.fc1(torch.ones(1, 1)).sum().backward()  # only fc1 gets grads: fc1 at step 1
    opt.step()
    named = dict(model.named_parameters())
    with pytest.raises(ValueError, match=re.escape("at different steps [0, 1]")):
        fg.state_from_torch(fg.adam(), opt, named)
    amsgrad = fg.adam(amsgrad=True)
    with pytest.raises(ValueError, match=re.escape("options keep state")):
        fg.state_to_torch(
            amsgrad, amsgrad.init(fg.params(model)), torch.optim.Adam(model.parameters()), named
        )


def test_skip_if_nonfinite_keeps_params_and_state():
    params = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    tx = fg.skip_if_nonfinite(fg.adam(lr=0.1))
    inner = fg.adam(lr=0.1)
    good = {"w": torch.tensor([0.1, -0.2]), "b": torch.tensor([0.3])}
    bad = {"w": torch.tensor([0.1, float("inf")]), "b": torch.tensor([float("nan")])}
    s, si = tx.init(params), inner.init(params)
    p, pi = dict(params), dict(params)
    for g in (good, bad, good, bad, bad, good):
        u, s = tx.update(g, s, p)
        p = fg.apply_updates(p, u)
        if all(torch.isfinite(t).all() for t in g.values()):  # the reference: skip in Python
            ui, si = inner.update(g, si, pi)
            pi = fg.apply_updates(pi, ui)
        assert_trees_close(p, pi)
        assert_trees_close(s.inner, si)
    assert int(s.skipped) == 3 and bool(s.last_finite)
    s0 = tx.init(params)
    check_compiles(
        tx.update,
        (good, s0, params),
        (bad, s0, params),
        (good, tx.update(bad, s0, params)[1], params),
    )


def dead_model():
    torch.manual_seed(0)
    m = SeedModel().double()
    with torch.no_grad():
        m.fc1.bias.fill_(-10.0)
    return m


class Branchy(nn.Module):
    """A deeper model where one branch is unused on some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU())
        self.head_a = nn.Linear(6, 1)
        self.head_b = nn.Linear(6, 1)

    def forward(self, x, use_b: bool):
        h = self.body(x)
        return self.head_a(h) + (self.head_b(h) if use_b else 0.0)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", ["seed", "branchy"])
def test_hooks_attach_equals_functional_path(kind, set_to_none):
    torch.manual_seed(1)
    if kind == "seed":
        a, b = dead_model(), dead_model()
        xs = [(torch.rand(3, 1, dtype=torch.float64),) for _ in range(8)]
    else:
        a = Branchy().double()
        b = Branchy().double()
        b.load_state_dict(a.state_dict())
        xs = [(torch.randn(4, 2, dtype=torch.float64), i % 3 != 0) for i in range(9)]
    groups = fg.group_by_module(a)
    rule = fg.rules.zero_fix()
    handle = fg.hooks.attach(a, rule, groups)
    opt = torch.optim.Adam(a.parameters(), lr=0.01)
    tx = fg.chain(fg.per_group(rule, groups), fg.adam(lr=0.01))

    def loss(p, x, *extra):
        return (fg.call(b, p, x, *extra) ** 2).mean()

    params = fg.params(b)
    state = tx.init(params)
    for args in xs:
        opt.zero_grad(set_to_none=set_to_none)
        (a(*args) ** 2).mean().backward()
        # What the hooks left in .grad equals the rule on torch.func's gradients.
        raw = torch.func.grad(loss)(fg.params(a), *args)
        for names in groups.values():
            fixed = ref_zero_fix({n: raw[n] for n in names})
            for n in names:
                torch.testing.assert_close(
                    a.get_parameter(n).grad, fixed[n], rtol=1e-12, atol=1e-14
                )
        opt.step()
        params, state, _ = fg.make_step(loss, tx, donate=True)(params, state, *args)
    for n, p in a.named_parameters():
        torch.testing.assert_close(p.detach(), params[n], rtol=1e-10, atol=1e-12)
    # After remove(), .grad is raw again.
    handle.remove()
    opt.zero_grad(set_to_none=True)
    (a(*xs[0]) ** 2).mean().backward()
    if kind == "seed":  # fc1 is dead: its raw gradient is zero, not the rule's 1.0
        assert torch.equal(a.fc1.bias.grad, torch.zeros(2, dtype=torch.float64))
    else:  # head_b is unused on xs[0]: nothing creates its .grad any more
        assert a.head_b.weight.grad is None


def test_hook_errors():
    model = SeedModel()
    with pytest.raises(KeyError, match=re.escape("group 'fc9' names parameter 'fc9.weight'")):
        fg.hooks.attach(model, fg.rules.zero_fix(), {"fc9": ["fc9.weight"]})
    with pytest.raises(
        TypeError, match=re.escape("Did you pass rules.zero_fix instead of rules.zero_fix(...)?")
    ):
        fg.hooks.attach(model, fg.rules.zero_fix, fg.group_by_module(model))  # type: ignore[arg-type]


def _amp_run(scaler_for_rule: bool, use_scaler: bool, steps: int = 5):
    """fg.hooks.attach + torch.optim.SGD on a model whose first layer is dead (SGD, not
    Adam: Adam's steps do not depend on a constant gradient's size, so it would hide
    a rule applied in the wrong units)."""
    torch.manual_seed(0)
    model = SeedModel()
    with torch.no_grad():
        model.fc1.bias.fill_(-10.0)  # fc1's gradients are all zero: the rule fills 1.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if use_scaler else None
    handle = fg.hooks.attach(
        model,
        fg.rules.zero_fix(),
        fg.group_by_module(model),
        scaler=scaler if scaler_for_rule else None,
    )
    x = torch.rand(4, 1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.mean(torch.square(5.0 - model(x).sum()))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    handle.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_hooks_with_a_grad_scaler_apply_the_rule_in_the_loss_units():
    want = _amp_run(scaler_for_rule=False, use_scaler=False)
    got = _amp_run(scaler_for_rule=True, use_scaler=True)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    # Without scaler=, the rule fills the *scaled* zeros with 1.0, which unscale_
    # divides by 1024: the dead layer then moves by another amount.
    naive = _amp_run(scaler_for_rule=False, use_scaler=True)
    assert not torch.allclose(naive["fc1.bias"], want["fc1.bias"], rtol=1e-3, atol=1e-5)
