"""fg.sgd, fg.rmsprop, fg.adagrad, fg.adafactor, fg.muon, fg.lion (#24).

Each against its reference step for step: ``torch.optim``'s twin in float64 (rel
1e-10) on every combination of its options, on the flat layout of ``fg.params``
and on a hand-built per-tensor dict; Muon in float32 against torch's bfloat16
iteration (rel 1e-5); Lion against the paper's update written out here as a plain
loop. Then the same everywhere Adam works: tensor and scheduled learning rates,
weight-decay masks, one compiled graph, ``per_sample=``, ``accumulate``,
``fg.sharded`` (2 gloo ranks), checkpoints, migration both ways, half precision.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from references import TWIN_STEPS, mlp, mlp_data, mse, torch_run

import funcgrad as fg

D = torch.float64
STEPS = TWIN_STEPS


def _grid(**options):
    """Every combination of the given option values, as dicts."""
    keys = list(options)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*options.values())]


SGD = [
    kw
    for kw in _grid(
        momentum=[0.0, 0.9],
        dampening=[0.0, 0.3],
        nesterov=[False, True],
        weight_decay=[0.0, 0.1],
        maximize=[False, True],
    )
    if not (kw["nesterov"] and (kw["momentum"] == 0 or kw["dampening"] != 0))
]
RMSPROP = _grid(
    alpha=[0.99, 0.8],
    momentum=[0.0, 0.9],
    centered=[False, True],
    weight_decay=[0.0, 0.1],
    maximize=[False, True],
)
ADAGRAD = _grid(
    lr_decay=[0.0, 0.3],
    weight_decay=[0.0, 0.1],
    initial_accumulator_value=[0.0, 0.5],
    eps=[1e-10, 1e-3],
    maximize=[False, True],
)
ADAFACTOR = _grid(
    beta2_decay=[-0.8, -0.5],
    eps=[(None, 1e-3), (1e-20, 0.5)],
    d=[1.0, 1.5],
    weight_decay=[0.0, 0.1],
    maximize=[False, True],
)
MUON = _grid(
    momentum=[0.95, 0.8],
    nesterov=[True, False],
    weight_decay=[0.1, 0.0],
    adjust_lr_fn=[None, "original", "match_rms_adamw"],
    ns_steps=[5, 2],
)

TWINS = {
    "sgd": (fg.sgd, torch.optim.SGD, 0.05, SGD),
    "rmsprop": (fg.rmsprop, torch.optim.RMSprop, 0.01, RMSPROP),
    "adagrad": (fg.adagrad, torch.optim.Adagrad, 0.1, ADAGRAD),
    "adafactor": (fg.adafactor, torch.optim.Adafactor, 0.05, ADAFACTOR),
}
CASES = [(name, kw) for name, (_, _, _, grid) in TWINS.items() for kw in grid]


def fg_run(model, tx, layout="flat", steps=STEPS, lr_tensor=None, lrs=None, **step_kw):
    x, y = mlp_data(next(model.parameters()).dtype)
    params = fg.params(model) if layout == "flat" else {
        n: p.detach().clone() for n, p in model.named_parameters()
    }  # fmt: skip
    state = tx.init(params)
    step = fg.make_step(mse(model), tx, **step_kw)
    for i in range(steps):
        if lrs is not None:
            lr_tensor.fill_(lrs[i])
        params, state, _ = step(params, state, x, y)
    return params, state


def assert_params_close(got, want, rtol=1e-10, atol=1e-12):
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol)


@pytest.mark.parametrize("layout", ["flat", "dict"])
@pytest.mark.parametrize(("name", "kw"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_equal_to_torch_optim_on_every_option(name, kw, layout):
    make, twin, lr, _ = TWINS[name]
    model = mlp()
    ref = copy.deepcopy(model)
    want = torch_run(ref, twin(ref.parameters(), lr=lr, **kw))
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, _ = fg_run(model, make(lr=lr, **kw), layout)
    assert_params_close(got, want)
    assert any((got[n] != moved[n]).any() for n in got)  # it trained


@pytest.mark.parametrize("layout", ["flat", "dict"])
@pytest.mark.parametrize("kw", MUON, ids=[str(i) for i in range(len(MUON))])
def test_muon_equal_to_torch_muon(kw, layout):
    """float32 parameters, the Newton-Schulz iteration in bfloat16 as torch's."""
    model = mlp(torch.float32, bias=False)
    ref = copy.deepcopy(model)
    want = torch_run(ref, torch.optim.Muon(ref.parameters(), lr=0.02, **kw))
    got, _ = fg_run(model, fg.muon(lr=0.02, **kw), layout)
    assert_params_close(got, want, rtol=1e-5, atol=1e-7)


def test_muon_spectral_unclamped_scales_by_sqrt_rows_over_cols():
    """torch 2.14's adjust_lr_fn="spectral_unclamped" (lr * sqrt(A / B), without the
    original's max(1, .)): on torch 2.13, which lacks it, against the original ratio
    (the 2.14 run compares it with torch.optim.Muon in tests/test_optim_db.py)."""
    g = torch.Generator().manual_seed(0)
    params = {"wide": torch.randn(3, 5, generator=g), "tall": torch.randn(6, 2, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}

    def update(fn):
        tx = fg.muon(lr=0.1, weight_decay=0.0, adjust_lr_fn=fn)
        return tx.update(grads, tx.init(params), params)[0]

    got, original = update("spectral_unclamped"), update("original")
    for k, (a, b) in (("wide", (3, 5)), ("tall", (6, 2))):
        scale = (a / b) ** 0.5 / max(1.0, a / b) ** 0.5
        torch.testing.assert_close(got[k], original[k] * scale, rtol=1e-6, atol=1e-8)


def lion_reference(params, grads_per_step, lr, b1, b2, wd, decays):
    """The paper's Lion (Chen et al. 2023, Program 1), tensor by tensor, in place."""
    p = {n: t.clone() for n, t in params.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    for step, grads in enumerate(grads_per_step):
        for n, g in grads.items():
            c = b1 * m[n] + (1 - b1) * g
            update = torch.sign(c) + (wd * p[n] if decays[n] else 0.0)
            p[n] = p[n] - lr[step] * update
            m[n] = b2 * m[n] + (1 - b2) * g
    return p


@pytest.mark.parametrize("layout", ["flat", "dict"])
@pytest.mark.parametrize(
    "kw",
    _grid(b1=[0.9, 0.5], b2=[0.99, 0.7], weight_decay=[0.0, 0.2]),
)
def test_lion_equal_to_the_paper(kw, layout):
    model = mlp()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    tx = fg.lion(lr=0.01, **kw)
    x, y = mlp_data()
    params = fg.params(model) if layout == "flat" else dict(start)
    state = tx.init(params)
    grads = []
    for _ in range(STEPS):  # the gradients funcgrad saw, replayed into the reference
        g = torch.func.grad(mse(model))(params, x, y)
        grads.append({n: t.clone() for n, t in g.items()})
        updates, state = tx.update(g, state, params)
        params = fg.apply_updates(params, updates)
    decays = dict.fromkeys(start, True)
    want = lion_reference(
        start, grads, [0.01] * STEPS, kw["b1"], kw["b2"], kw["weight_decay"], decays
    )
    assert_params_close(params, want)


# ---- learning rates: a 0-d tensor edited between steps, a schedule, and masks

NOMINAL = {
    "sgd": dict(momentum=0.9, weight_decay=0.1),
    "rmsprop": dict(momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": dict(lr_decay=0.2, weight_decay=0.1),
    "adafactor": dict(weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_tensor_lr_edited_between_steps_equals_torch(name):
    make, twin, lr, _ = TWINS[name]
    lrs = [lr, lr / 2, lr * 3, lr]
    model = mlp()
    ref = copy.deepcopy(model)
    want = torch_run(ref, twin(ref.parameters(), lr=lr, **NOMINAL[name]), lrs=lrs)
    lr_t = torch.tensor(lr, dtype=D)
    got, _ = fg_run(model, make(lr=lr_t, **NOMINAL[name]), lr_tensor=lr_t, lrs=lrs)
    assert_params_close(got, want)


@pytest.mark.parametrize("name", list(TWINS))
def test_schedule_equals_torch_lambda_lr(name):
    make, twin, lr, _ = TWINS[name]
    model = mlp()
    ref = copy.deepcopy(model)
    opt = twin(ref.parameters(), lr=lr, **NOMINAL[name])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + e))
    want = torch_run(ref, opt, scheduler=sched)
    got, _ = fg_run(model, make(lr=lambda count: lr / (1.0 + count), **NOMINAL[name]))
    assert_params_close(got, want)


@pytest.mark.parametrize("name", [*TWINS, "muon"])
def test_mask_equals_torch_decay_and_no_decay_groups(name):
    """Decay on the first layer only: the flat buffer is split by the mask."""
    if name == "muon":
        make, twin, lr, kw, dtype = fg.muon, torch.optim.Muon, 0.02, {}, torch.float32
        model = mlp(dtype, bias=False)
    else:
        (make, twin, lr, _), kw, dtype = TWINS[name], dict(NOMINAL[name]), D
        model = mlp()
    kw["weight_decay"] = 0.3
    ref = copy.deepcopy(model)
    decay = [p for n, p in ref.named_parameters() if n.startswith("0.")]
    rest = [p for n, p in ref.named_parameters() if not n.startswith("0.")]
    opt = twin([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=lr, **kw)
    want = torch_run(ref, opt)
    got, _ = fg_run(model, make(lr=lr, mask=lambda n, p: n.startswith("0."), **kw))
    rtol = 1e-5 if name == "muon" else 1e-10
    assert_params_close(got, want, rtol=rtol, atol=1e-7 if name == "muon" else 1e-12)


def test_lion_schedule_and_mask_equal_the_paper():
    model = mlp()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lrs = [0.01 / (1.0 + i) for i in range(STEPS)]
    tx = fg.lion(lr=lambda c: 0.01 / (1.0 + c), weight_decay=0.5, mask=lambda n, p: p.ndim > 1)
    x, y = mlp_data()
    params, state, grads = fg.params(model), None, []
    state = tx.init(params)
    for _ in range(STEPS):
        g = torch.func.grad(mse(model))(params, x, y)
        grads.append({n: t.clone() for n, t in g.items()})
        updates, state = tx.update(g, state, params)
        params = fg.apply_updates(params, updates)
    decays = {n: t.ndim > 1 for n, t in start.items()}
    assert_params_close(params, lion_reference(start, grads, lrs, 0.9, 0.99, 0.5, decays))
