"""One optimizer kernel, three ways to run it (funcgrad/optim/_kernel.py, its operations
in funcgrad/optim/_ops.py): tensor by tensor out of place (traced, transformed), over
lists with ``torch._foreach_*`` (eager), and into borrowed buffers (large CPU tensors of the donated eager step).
Every elementwise optimizer, every dtype: the same bits on every path, against the
per-tensor loop that ``torch.compile`` traces (itself tested against torch.optim in
tests/test_optimizers.py and tests/test_adam.py)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest
import torch
from references import adam_grads_at, adam_params

import funcgrad as fg
from funcgrad.core import _scratch
from funcgrad.optim import _kernel, _ops

MASK = {"a.weight": True, "a.bias": False, "b.weight": True, "scalar": False, "f64": True}
SCHEDULE = fg.cosine_decay(0.05, 10)

ADAM = [
    (f"{'adamw' if dec else 'adam'}-wd{wd}-ams{int(ams)}-max{int(mx)}", dec, wd, ams, mx)
    for dec, wd, ams, mx in itertools.product(
        [False, True], [0.0, 0.1], [False, True], [False, True]
    )
]
OPTIMIZERS = {
    **{
        name: (
            lambda dec=dec, wd=wd, ams=ams, mx=mx: (fg.adamw if dec else fg.adam)(
                lr=SCHEDULE, weight_decay=wd, amsgrad=ams, maximize=mx, mask=MASK
            )
        )
        for name, dec, wd, ams, mx in ADAM
    },
    "sgd": lambda: fg.sgd(lr=SCHEDULE),
    "sgd-momentum-dampening-wd-max": lambda: fg.sgd(
        lr=SCHEDULE, momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True, mask=MASK
    ),
    "sgd-nesterov": lambda: fg.sgd(lr=SCHEDULE, momentum=0.9, nesterov=True),
    "rmsprop": lambda: fg.rmsprop(lr=SCHEDULE),
    "rmsprop-centered-momentum-wd-max": lambda: fg.rmsprop(
        lr=SCHEDULE, centered=True, momentum=0.5, weight_decay=0.1, maximize=True, mask=MASK
    ),
    "adagrad-decay-wd": lambda: fg.adagrad(
        lr=SCHEDULE, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1, mask=MASK
    ),
    "lion-wd": lambda: fg.lion(lr=SCHEDULE, weight_decay=0.1, mask=MASK),
    "lion": lambda: fg.lion(lr=SCHEDULE),
}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _run(make, dtype, mode, monkeypatch, scratch):
    """10 steps of ``make()`` on mixed-dtype parameters, on the path ``mode`` names."""
    monkeypatch.setattr(_kernel, "composing", lambda *inputs: mode == "loop")
    monkeypatch.setattr(_kernel, "BIG", 0 if mode == "borrowed" else _scratch.BIG)
    monkeypatch.setattr(_ops, "BIG", 0 if mode == "borrowed" else _scratch.BIG)
    params = adam_params(dtype)
    params["f64"] = torch.linspace(-1, 1, 7, dtype=torch.float64)  # a second dtype
    tx = make()
    state = tx.init(params)
    outs = []
    for step in range(10):
        with _scratch.lending(scratch):
            updates, state = tx.update(adam_grads_at(params, step), state, params)
        # What make_step's commit does: copy the results out, then give the borrowed
        # buffers back (the next step writes into them again).
        updates, state = torch.utils._pytree.tree_map(torch.clone, (updates, state))
        scratch.reclaim()
        params = fg.apply_updates(params, updates)
        outs.append((updates, state))
    return outs


def _assert_same_bits(got, want, mode):
    for (u1, s1), (u2, s2) in zip(got, want, strict=True):
        a_leaves = torch.utils._pytree.tree_leaves((u1, s1))
        b_leaves = torch.utils._pytree.tree_leaves((u2, s2))
        assert len(a_leaves) == len(b_leaves)
        for a, b in zip(a_leaves, b_leaves, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), mode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lists_and_borrowed_buffers_equal_the_per_tensor_loop_bit_for_bit(name, dtype, monkeypatch):
    """Eagerly an elementwise optimizer runs on lists (torch._foreach_*), or, for
    large tensors inside a donated eager step, tensor by tensor into buffers kept from
    the previous step; traced, tensor by tensor. The same bits: 10 steps, two dtypes,
    a decay mask, a schedule."""
    make = OPTIMIZERS[name]
    scratch = _scratch.Scratch()
    calls = {"lists": 0}
    mul = _ops.Lists.mul

    def counted(self, a, b):
        calls["lists"] += 1
        return mul(self, a, b)

    monkeypatch.setattr(_ops.Lists, "mul", counted)
    want = _run(make, dtype, "loop", monkeypatch, scratch)
    assert calls["lists"] == 0 and not scratch.free
    _assert_same_bits(_run(make, dtype, "lists", monkeypatch, scratch), want, "lists")
    assert calls["lists"] > 0  # the lists path ran
    assert not scratch.free
    _assert_same_bits(_run(make, dtype, "borrowed", monkeypatch, scratch), want, "borrowed")
    assert scratch.free  # the borrowed run did borrow


def test_adam_borrows_four_buffers_per_large_tensor():
    """The donated step keeps its borrowed buffers between steps: Adam's kernel hands
    its temporaries back (``Ops.release``) so a large tensor holds four (update, two
    moments, one temporary), as the hand-written version did."""
    scratch = _scratch.Scratch()
    params = {"w": torch.randn(256, 256, dtype=torch.float64)}
    tx = fg.adam(lr=0.1)
    state = tx.init(params)
    for step in range(3):
        with _scratch.lending(scratch):
            updates, state = tx.update({"w": torch.sin(params["w"]) + step}, state, params)
        updates, state = torch.utils._pytree.tree_map(torch.clone, (updates, state))
        scratch.reclaim()
        params = fg.apply_updates(params, updates)
    assert sum(len(v) for v in scratch.free.values()) == 4


def test_tensor_hyperparameters_keep_the_per_tensor_loop_and_its_values():
    """Adam with 0-d tensor betas runs tensor by tensor (the lists take Python floats
    only): the same values as with the float, to float64 rounding of the beta."""
    params = adam_params(torch.float64)
    grads = adam_grads_at(params, 0)
    t = torch.tensor
    a = fg.adam(lr=0.1, betas=(t(0.9, dtype=torch.float64), t(0.999, dtype=torch.float64)))
    b = fg.adam(lr=0.1, betas=(0.9, 0.999))
    ua, _ = a.update(grads, a.init(params), params)
    ub, _ = b.update(grads, b.init(params), params)
    for k in ua:
        torch.testing.assert_close(ua[k], ub[k], rtol=1e-15, atol=0)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "lerp", "maximum", "where"])
@pytest.mark.parametrize("scalar", ["list", "float", "tensor", "float-first", "tensor-first"])
def test_each_list_operation_equals_the_plain_one(op, scalar):
    """Each of Lists' operations, with a second list or a shared scalar (a float or a
    0-d tensor) on either side, equals Ops' plain operation tensor by tensor."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(s, generator=g) for s in [(3,), (2, 4), ()]]
    ys = [torch.rand(s, generator=g) + 0.5 for s in [(3,), (2, 4), ()]]
    c: object = {"float": 0.3, "tensor": torch.tensor(0.3)}.get(scalar.split("-")[0], ys)
    plain, lists = _ops.PLAIN, _ops.LISTS

    def both(*args):
        per = [
            getattr(plain, op)(*(a[i] if isinstance(a, list) else a for a in args))
            for i in range(len(xs))
        ]
        return per, getattr(lists, op)(*args)

    if op == "where":
        per, got = both(torch.tensor(True), xs, ys)
    elif op == "lerp":
        per, got = both(xs, ys, c if scalar != "list" else 0.3)
    elif op == "maximum":
        per, got = both(xs, ys)
    elif scalar.endswith("first"):
        per, got = both(c, xs)
    else:
        per, got = both(xs, c)
    assert len(got) == len(per)
    for a, b in zip(got, per, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_"])
@pytest.mark.parametrize("other", ["list", "float", "tensor"])
def test_in_place_list_operations_write_their_first_argument(op, other):
    """``Lists.add_`` etc. write into their first list (a kernel's own temporaries)
    and give the plain operation's values; ``PLAIN``'s leave their arguments alone."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(s, generator=g) for s in [(3,), (2, 4)]]
    ys = [torch.randn(s, generator=g) for s in [(3,), (2, 4)]]
    b: object = {"float": 0.7, "tensor": torch.tensor(0.7)}.get(other, ys)
    plain = [getattr(torch, op[:-1])(x, b if not isinstance(b, list) else b[i])
             for i, x in enumerate(xs)]  # fmt: skip
    before = [x.clone() for x in xs]
    kept = getattr(_ops.PLAIN, op)(xs[0], b if not isinstance(b, list) else b[0])
    assert torch.equal(xs[0], before[0]) and torch.equal(kept, plain[0])
    got = getattr(_ops.LISTS, op)(xs, b)
    assert got is xs
    for a, want in zip(got, plain, strict=True):
        assert torch.equal(a, want)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fg.adam(lr=0.01, weight_decay=0.1),
        lambda: fg.sgd(lr=0.01, momentum=0.9),
        lambda: fg.rmsprop(lr=0.01, centered=True),
        lambda: fg.lion(lr=0.001),
    ],
)
def test_a_per_name_state_keeps_its_form_under_flat_params(make):
    """A state made per name (as fg.state_from_torch makes it) with fg.params' flat
    gradients: the step computes on the flat buffers and hands the state back per name,
    so a donated step can write it into the given one; the values equal a flat state's."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    def loss(p, x):
        return fg.call(model, p, x).square().mean()

    x = torch.randn(5, 3, dtype=torch.float64)
    runs = []
    for per_name in (False, True):
        params = fg.params(model)
        saved = {k: v.clone() for k, v in params.views().items()}
        tx = make()
        state = tx.init(dict(params.views()) if per_name else params)
        step = fg.make_step(loss, tx, donate=True)
        for _ in range(3):
            step(params, state, x)
        slots = [v for v in state[1:-1] if isinstance(v, Mapping) and v]  # less hyperparams
        assert slots and all((type(v) is dict) == per_name for v in slots)
        runs.append(({k: v.clone() for k, v in params.views().items()}, state))
        with torch.no_grad():  # back to the start for the other run
            for k, v in params.views().items():
                v.copy_(saved[k])
    for k in runs[0][0]:
        assert torch.equal(runs[0][0][k], runs[1][0][k])
