"""Updates under torch.func transforms and differentiating autograd (meta-learning,
learnable hyperparameters, vmapped tasks and ensembles).

References: a hand-written Adam in plain torch ops differentiated by autograd with
``create_graph=True``, central finite differences, and Python loops over tasks and
models. float64 throughout, so agreement is to ~1e-10.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from references import assert_trees_close, check_compiles
from torch import Tensor, nn
from torch.func import grad, jacrev, vmap

import funcgrad as fg
from funcgrad.core._compose import composing

D = torch.float64


def net_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    """A 1-8-1 tanh net; ``dead.weight`` never reaches the loss (an all-zero group)."""
    h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    relu = torch.relu(h @ p["fc2.weight"].T + p["fc2.bias"])  # dead units: exact zeros
    out = relu @ p["fc3.weight"].T
    return ((out - y) ** 2).mean() + 0.0 * p["dead.weight"].sum()


def smooth_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    """The same net with tanh everywhere and no dead parameter: no exact zeros."""
    h = torch.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    h = torch.tanh(h @ p["fc2.weight"].T + p["fc2.bias"])
    return ((h @ p["fc3.weight"].T - y) ** 2).mean()


GROUPS = fg.Groups(
    {
        "fc1": ("fc1.weight", "fc1.bias"),
        "fc2": ("fc2.weight", "fc2.bias"),
        "fc3": ("fc3.weight",),
        "dead": ("dead.weight",),
    }
)


def init_params(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(8, 1, generator=g, dtype=D),
        "fc1.bias": torch.randn(8, generator=g, dtype=D),
        "fc2.weight": torch.randn(6, 8, generator=g, dtype=D) * 0.6,
        "fc2.bias": torch.randn(6, generator=g, dtype=D) - 0.3,
        "fc3.weight": torch.randn(1, 6, generator=g, dtype=D),
        "dead.weight": torch.randn(3, generator=g, dtype=D),
    }


def task(seed: int, n: int = 12) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    amp, phase = 0.5 + 2 * torch.rand((), generator=g), 3 * torch.rand((), generator=g)
    x = (torch.rand(n, 1, generator=g) * 10 - 5).to(D)
    return x, (amp * torch.sin(x - phase)).to(D)


def ref_zero_fix(g: dict[str, Tensor]) -> dict[str, Tensor]:
    """The seed rule per group, in plain torch ops."""
    out = dict(g)
    for names in GROUPS.values():
        dead = torch.stack([(g[n] == 0).all() for n in names]).all()
        for n in names:
            out[n] = torch.where(dead, 1.0, torch.where(g[n] == 0, 0.5, g[n]))
    return out


def ref_adam_inner(
    p: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    lr: Tensor | float,
    steps: int = 3,
    *,
    rule: bool = False,
    b1: Tensor | float = 0.9,
    b2: Tensor | float = 0.999,
    eps: float = 1e-8,
    wd: Tensor | float = 0.0,
    eps_root: float = 0.0,
    loss: Callable[..., Tensor] = net_loss,
) -> Tensor:
    """Adam(W) written out in plain torch ops, autograd with create_graph=True."""
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(t) for k, t in p.items()}
    for t in range(1, steps + 1):
        gs = torch.autograd.grad(loss(p, x, y), list(p.values()), create_graph=True)
        g = dict(zip(p, gs, strict=True))
        if rule:
            g = ref_zero_fix(g)
        new = {}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh, vh = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            new[k] = p[k] * (1 - lr * wd) - lr * mh / (torch.sqrt(vh + eps_root) + eps)
        p = new
    return loss(p, x, y)


def fg_inner(
    p: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    make_tx: Callable[[], fg.GradientTransformation],
    steps: int = 3,
    loss: Callable[..., Tensor] = net_loss,
) -> Tensor:
    """The same inner loop through funcgrad: grad, tx.update, apply_updates."""
    tx = make_tx()
    s = tx.init(p)
    for _ in range(steps):
        g = grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        p = fg.apply_updates(p, u)
    return loss(p, x, y)


def ref_meta_grads(p0, x, y, lr, **kw):
    leaves = {k: t.clone().requires_grad_() for k, t in p0.items()}
    lr_leaf = lr.clone().requires_grad_()
    out = ref_adam_inner(leaves, x, y, lr_leaf, **kw)
    gs = torch.autograd.grad(out, [*leaves.values(), lr_leaf])
    return dict(zip(p0, gs[:-1], strict=True)), gs[-1]


def chain_with_rule(lr: Tensor) -> fg.GradientTransformation:
    return fg.chain(fg.per_group(fg.rules.zero_fix(), GROUPS), fg.adam(lr=lr))


@pytest.mark.parametrize("rule", [False, True], ids=["adam", "seed-rule+adam"])
def test_maml_meta_gradient_equals_hand_written_adam(rule):
    """The issue's MAML inner loop: d(meta-loss)/d(params, lr) through 3 Adam steps.
    Plain Adam on a net with no exact-zero gradient (see the NaN test below); the
    seed rule on one with an all-zero layer and dead units (their zeros become
    constants, so the derivative is defined)."""
    p0, (x, y) = init_params(), task(0)
    lr = torch.tensor(0.05, dtype=D)
    loss = net_loss if rule else smooth_loss
    if not rule:
        del p0["dead.weight"]

    def meta(p, lr):
        make = (lambda: chain_with_rule(lr)) if rule else (lambda: fg.adam(lr=lr))
        return fg_inner(p, x, y, make, loss=loss)

    g_p, g_lr = grad(meta, argnums=(0, 1))(p0, lr)
    want_p, want_lr = ref_meta_grads(p0, x, y, lr, rule=rule, loss=loss)
    assert_trees_close(g_p, want_p, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_lr, want_lr, rtol=1e-10, atol=0)
    if rule:  # the rule fired both branches: dead is all-zero, fc2 has zeros among values
        raw = grad(net_loss)(p0, x, y)
        assert (raw["dead.weight"] == 0).all()
        assert (raw["fc2.weight"] == 0).any() and (raw["fc2.weight"] != 0).any()
    # and d/dlr against central finite differences of the funcgrad loop itself
    h = 1e-6
    fd = (meta(p0, lr + h) - meta(p0, lr - h)) / (2 * h)
    torch.testing.assert_close(g_lr, fd, rtol=1e-6, atol=0)


def test_create_graph_autograd_through_updates_equals_hand_written():
    """The same loop with torch.autograd.grad(create_graph=True) instead of torch.func."""
    p0, (x, y) = init_params(), task(1)
    leaves = {k: t.clone().requires_grad_() for k, t in p0.items()}
    lr = torch.tensor(0.05, dtype=D, requires_grad=True)
    tx = chain_with_rule(lr)
    p, s = leaves, tx.init(leaves)
    for _ in range(3):
        gs = torch.autograd.grad(net_loss(p, x, y), list(p.values()), create_graph=True)
        u, s = tx.update(dict(zip(p, gs, strict=True)), s, p)
        p = fg.apply_updates(p, u)
    got = torch.autograd.grad(net_loss(p, x, y), [*leaves.values(), lr])
    want_p, want_lr = ref_meta_grads(p0, x, y, lr.detach(), rule=True)
    assert_trees_close(dict(zip(p0, got[:-1], strict=True)), want_p, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[-1], want_lr, rtol=1e-10, atol=0)


def test_learnable_betas_and_weight_decay():
    """b1, b2 and AdamW's weight_decay as 0-d tensors with gradients."""
    p0, (x, y) = init_params(), task(2)
    del p0["dead.weight"]
    hp = torch.tensor([0.05, 0.8, 0.95, 0.1], dtype=D)  # lr, b1, b2, wd

    def meta(hp):
        lr, b1, b2, wd = hp.unbind()
        tx = lambda: fg.adamw(lr=lr, betas=(b1, b2), weight_decay=wd)  # noqa: E731
        return fg_inner(p0, x, y, tx, steps=4, loss=smooth_loss)

    got = grad(meta)(hp)
    leaf = hp.clone().requires_grad_()
    lr, b1, b2, wd = leaf.unbind()
    p = {k: t.clone() for k, t in p0.items()}
    for t in p.values():
        t.requires_grad_()
    want = torch.autograd.grad(
        ref_adam_inner(p, x, y, lr, steps=4, b1=b1, b2=b2, wd=wd, loss=smooth_loss), leaf
    )[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    # the value of the loop equals the same loop with float hyperparameters
    floats = fg_inner(
        p0, x, y, lambda: fg.adamw(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1), steps=4,
        loss=smooth_loss,
    )  # fmt: skip
    torch.testing.assert_close(meta(hp), floats, rtol=1e-12, atol=0)


def test_exact_zero_first_gradient_nan_derivative_and_eps_root():
    """sqrt(nu) has no derivative at nu == 0: the meta-gradient through an entry whose
    first gradient is exactly zero (here z, at the minimum of z**2) is NaN, in
    funcgrad and in the hand-written Adam alike. eps_root (optax's) makes it finite,
    equal to the reference with the same eps_root."""
    x, y = task(3)

    def quad_loss(p, x, y):
        return ((x @ p["a"] - y.squeeze(-1)) ** 2).mean() + (p["z"] ** 2).sum()

    p0 = {"a": torch.tensor([0.3], dtype=D), "z": torch.zeros(2, dtype=D)}
    lr = torch.tensor(0.05, dtype=D)

    def meta(p, eps_root=0.0):
        return fg_inner(p, x, y, lambda: fg.adam(lr=lr, eps_root=eps_root), loss=quad_loss)

    plain = grad(meta)(p0)
    want, _ = ref_meta_grads(p0, x, y, lr, loss=quad_loss)
    assert torch.isnan(plain["z"]).all() and torch.isnan(want["z"]).all()
    rooted = grad(meta)(p0, 1e-12)
    want_rooted, _ = ref_meta_grads(p0, x, y, lr, eps_root=1e-12, loss=quad_loss)
    assert all(torch.isfinite(t).all() for t in rooted.values())
    assert_trees_close(rooted, want_rooted, rtol=1e-9, atol=1e-12)


def test_vmap_over_tasks_equals_a_loop_over_tasks():
    """Batched MAML: one vmapped meta-gradient over 4 tasks against a loop."""
    p0 = init_params()
    lr = torch.tensor(0.05, dtype=D)
    tasks = [task(i) for i in range(4)]
    xs, ys = torch.stack([t[0] for t in tasks]), torch.stack([t[1] for t in tasks])

    def meta(p, x, y):
        return fg_inner(p, x, y, lambda: chain_with_rule(lr))

    batched = vmap(grad(meta), in_dims=(None, 0, 0))(p0, xs, ys)
    for i, (x, y) in enumerate(tasks):
        one = grad(meta)(p0, x, y)
        assert_trees_close({k: v[i] for k, v in batched.items()}, one, rtol=1e-10, atol=1e-13)


def test_vmapped_ensemble_trains_like_each_model_alone():
    """4 models trained 5 steps in one vmapped step (functorch's ensembling recipe),
    and in one vmapped fg.make_step, against fg.make_step on each model alone (the
    eager fast path)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).to(D) for _ in range(4)]
    base = copy.deepcopy(models[0]).to("meta")

    def loss(p, x, y):
        return ((torch.func.functional_call(base, p, (x,)) - y) ** 2).mean()

    tx = fg.chain(
        fg.per_group(fg.rules.zero_fix(), fg.group_by_module(models[0])),
        fg.monitor(fg.group_by_module(models[0])),
        fg.adamw(lr=1e-2, weight_decay=0.1, mask=lambda n, p: p.ndim > 1),
    )
    stacked = {k: v.detach() for k, v in torch.func.stack_module_state(models)[0].items()}
    xs, ys = torch.randn(4, 16, 3, dtype=D), torch.randn(4, 16, 1, dtype=D)

    def user_step(p, s, x, y):
        u, s = tx.update(grad(loss)(p, x, y), s, p)
        return fg.apply_updates(p, u), s

    made = vmap(fg.make_step(loss, tx))
    p1, s1 = stacked, vmap(tx.init)(stacked)
    p2, s2 = p1, s1
    for _ in range(5):
        p1, s1 = vmap(user_step)(p1, s1, xs, ys)
        p2, s2, _ = made(p2, s2, xs, ys)
    for m in range(4):
        p = {k: v[m].clone() for k, v in stacked.items()}
        s = tx.init(p)
        step = fg.make_step(loss, tx, donate=True)
        for _ in range(5):
            p, s, _ = step(p, s, xs[m], ys[m])
        for got_p, got_s in ((p1, s1), (p2, s2)):
            assert_trees_close({k: v[m] for k, v in got_p.items()}, p, rtol=1e-10, atol=1e-13)
            picked = torch.utils._pytree.tree_map(lambda t, m=m: t[m], got_s)
            assert_trees_close(picked, s, rtol=1e-10, atol=1e-13)


def _updates_fn(tx, state):
    def f(g, p):
        u, _ = tx.update(g, state, p)
        return u

    return f


def _fd_jacobian(f, g, p, wrt: str, h: float = 1e-6):
    """d(sum of updates * weights)/d(grads or params), by central differences."""
    base = g if wrt == "g" else p
    out = {}
    for k, t in base.items():
        col = torch.zeros_like(t)
        for i in range(t.numel()):
            e = torch.zeros_like(t).view(-1)
            e[i] = h
            e = e.view_as(t)
            plus = {**base, k: t + e}
            minus = {**base, k: t - e}
            a = f(plus, p) if wrt == "g" else f(g, plus)
            b = f(minus, p) if wrt == "g" else f(g, minus)
            col.view(-1)[i] = (a - b) / (2 * h)
        out[k] = col
    return out


TRANSFORMS = {
    "adam": lambda: fg.adam(lr=0.1),
    "adamw-amsgrad-mask": lambda: fg.adamw(
        lr=0.1, weight_decay=0.3, amsgrad=True, mask={"a": True, "b": False}
    ),
    "adam-maximize-l2-schedule": lambda: fg.adam(
        lr=fg.cosine_decay(0.1, 10), weight_decay=0.2, maximize=True
    ),
    "rule+adam": lambda: fg.chain(
        fg.per_group(fg.rules.zero_fix(), fg.Groups({"g": ("a", "b")})), fg.adam(lr=0.1)
    ),
    "clip+monitor+adam": lambda: fg.named_chain(
        ("clip", fg.clip_by_global_norm(0.5)),
        ("monitor", fg.monitor(fg.Groups({"g": ("a",)}))),
        ("adam", fg.adam(lr=0.1)),
    ),
    "accumulate": lambda: fg.accumulate(fg.adam(lr=0.1), every=2),
    "skip_if_nonfinite": lambda: fg.skip_if_nonfinite(fg.adamw(lr=0.1)),
    "add_noise": lambda: fg.chain(fg.add_noise(0.1, seed=3), fg.adam(lr=0.1)),
    "sgd-nesterov-l2": lambda: fg.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.2),
    "rmsprop-centered-momentum": lambda: fg.rmsprop(
        lr=0.01, momentum=0.5, centered=True, weight_decay=0.1
    ),
    "adagrad-decay": lambda: fg.adagrad(lr=0.1, lr_decay=0.2, initial_accumulator_value=0.3),
    "lion-mask": lambda: fg.lion(lr=0.1, weight_decay=0.3, mask={"a": True, "b": False}),
    "adafactor": lambda: fg.adafactor(lr=0.05, weight_decay=0.1, maximize=True),
    "partition": lambda: fg.partition(
        {
            "x": fg.adam(lr=0.1),
            "y": fg.chain(
                fg.per_group(fg.rules.clip_norm(0.2), fg.Groups({"b": ("b",)})), fg.adamw(lr=0.2)
            ),
        },
        {"a": "x", "b": "y"},
    ),
}


def _tree_inputs():
    g0 = torch.Generator().manual_seed(7)
    p = {"a": torch.randn(2, 3, generator=g0, dtype=D), "b": torch.randn(4, generator=g0, dtype=D)}
    g1 = {k: torch.randn(t.shape, generator=g0, dtype=D) for k, t in p.items()}
    g2 = {k: torch.randn(t.shape, generator=g0, dtype=D) for k, t in p.items()}
    return p, g1, g2


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_jacobian_of_one_update_equals_finite_differences(name):
    """jacrev of the second update (moments nonzero) with respect to the gradients
    and the parameters, against central differences; the update's value equals the
    eager fast path's, bit for bit."""
    tx = TRANSFORMS[name]()
    p, g1, g2 = _tree_inputs()
    _, state = tx.update(g1, tx.init(p), p)
    weights = {k: torch.linspace(-1, 2, t.numel(), dtype=D).view_as(t) for k, t in p.items()}

    def scalar(g, p):
        u = _updates_fn(tx, state)(g, p)
        return sum((u[k] * weights[k]).sum() for k in u)

    jg, jp = jacrev(scalar, argnums=(0, 1))(g2, p)
    assert_trees_close(jg, _fd_jacobian(scalar, g2, p, "g"), rtol=1e-6, atol=1e-9)
    assert_trees_close(jp, _fd_jacobian(scalar, g2, p, "p"), rtol=1e-6, atol=1e-9)
    eager = tx.update(g2, state, p)
    traced = vmap(lambda g: tx.update(g, state, p), randomness="same")(
        {k: t.unsqueeze(0) for k, t in g2.items()}
    )
    assert_trees_close(torch.utils._pytree.tree_map(lambda t: t[0], traced), eager)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_vmap_of_update_equals_a_loop(name):
    """vmap over a batch of (grads, state, params) against a Python loop."""
    tx = TRANSFORMS[name]()
    inputs = [_tree_inputs() for _ in range(1)]
    p, g1, g2 = inputs[0]
    batch_p = {k: torch.stack([t, 2 * t, -t]) for k, t in p.items()}
    batch_g = {k: torch.stack([t, t.flip(0), 3 * t]) for k, t in g2.items()}

    def two_steps(p, g):
        s = tx.init(p)
        u, s = tx.update(g1, s, p)
        u, s = tx.update(g, s, fg.apply_updates(p, u))
        return u, s

    got = vmap(two_steps, randomness="same")(batch_p, batch_g)
    for i in range(3):
        want = two_steps(
            {k: v[i] for k, v in batch_p.items()}, {k: v[i] for k, v in batch_g.items()}
        )
        assert_trees_close(torch.utils._pytree.tree_map(lambda t, i=i: t[i], got), want)


def test_composing_detects_transforms_and_recording_autograd():
    """The fast paths stay on for a plain eager step and off wherever they would be
    wrong."""
    t = torch.ones(2)
    assert not composing({"w": t}, t)
    seen = []
    vmap(lambda x: seen.append(composing()) or x)(t)
    grad(lambda x: seen.append(composing()) or x.sum())(t)
    assert seen == [True, True]
    leaf = torch.ones(2, requires_grad=True)
    assert composing({"w": leaf})
    with torch.no_grad():
        assert not composing({"w": leaf})


def test_grad_through_make_step_equals_the_hand_written_loop():
    """fg.make_step's step (eager, not donated) differentiated by torch.func.grad: the
    inner loop of MAML written with make_step gives the reference meta-gradient."""
    p0, (x, y) = init_params(), task(4)
    lr = torch.tensor(0.05, dtype=D)

    def meta(p, lr):
        tx = chain_with_rule(lr)
        step = fg.make_step(net_loss, tx)
        s = tx.init(p)
        for _ in range(3):
            p, s, _ = step(p, s, x, y)
        return net_loss(p, x, y)

    g_p, g_lr = grad(meta, argnums=(0, 1))(p0, lr)
    want_p, want_lr = ref_meta_grads(p0, x, y, lr, rule=True)
    assert_trees_close(g_p, want_p, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_lr, want_lr, rtol=1e-10, atol=0)


def test_compiled_meta_gradient_with_the_chain_built_inside():
    """torch.compile(fullgraph=True) of torch.func.grad through a chain built inside
    the compiled function (fg.adam(lr=<traced tensor>)): one graph, equal to eager."""
    p0, (x, y) = init_params(), task(5)

    def meta_grad(p, lr):
        return grad(lambda p, lr: fg_inner(p, x, y, lambda: chain_with_rule(lr)), argnums=(0, 1))(
            p, lr
        )

    check_compiles(
        meta_grad,
        (p0, torch.tensor(0.05, dtype=D)),
        (p0, torch.tensor(0.02, dtype=D)),
        rtol=1e-12,
        atol=1e-14,
    )


@pytest.mark.parametrize("who", ["fg.all_reduce_mean", "fg.sharded"])
def test_collectives_under_transforms_are_a_clear_error(one_rank, who):
    """Collectives have no derivative and no batching rule here: a clear error under
    grad, vmap and recording autograd, never a wrong answer; a plain step still runs."""

    def make(lr):
        if who == "fg.sharded":
            return fg.sharded(fg.adam(lr=lr))
        return fg.chain(fg.all_reduce_mean(), fg.adam(lr=lr))

    def meta(lr, w=None):
        p = {"w": torch.tensor([1.0, -2.0], dtype=D) if w is None else w}
        tx = make(lr)
        s = tx.init(p)
        u, s = tx.update({"w": 2 * p["w"]}, s, p)
        return (fg.apply_updates(p, u)["w"] ** 2).sum()

    message = re.escape(
        f"{who} runs collectives across torch.distributed ranks, which cannot be "
        "differentiated through or vmapped here"
    )
    lr = torch.tensor(0.1, dtype=D)
    with pytest.raises(RuntimeError, match=message):
        grad(meta)(lr)
    with pytest.raises(RuntimeError, match=message):
        vmap(meta)(torch.tensor([0.1, 0.2], dtype=D))
    with pytest.raises(RuntimeError, match=message):  # the gradients carry autograd history
        meta(lr, torch.tensor([1.0, -2.0], dtype=D, requires_grad=True))
    torch.testing.assert_close(meta(lr), fg_adam_reference(lr))


def fg_adam_reference(lr):
    """One Adam step on w = [1, -2] with g = 2w, by hand: each entry moves by -lr*sign."""
    w = torch.tensor([1.0, -2.0], dtype=D)
    return ((w - lr * torch.sign(w)) ** 2).sum()


def test_learnable_schedule_scale():
    """A schedule whose output carries a learnable tensor (peak * cosine): its
    gradient equals the hand-written Adam fed the same per-step learning rates."""
    p0, (x, y) = init_params(), task(6)
    del p0["dead.weight"]
    peak = torch.tensor(0.08, dtype=D)
    cosine = fg.cosine_decay(1.0, decay_steps=4, alpha=0.1)

    def meta(peak):
        return fg_inner(
            p0, x, y, lambda: fg.adam(lr=lambda c: peak * cosine(c)), steps=3, loss=smooth_loss
        )

    got = grad(meta)(peak)
    leaf = peak.clone().requires_grad_()
    # The hand-written loop with lr_t = peak * cosine(t - 1), one step at a time.
    p = {k: t.clone().requires_grad_() for k, t in p0.items()}
    m = {k: torch.zeros_like(t) for k, t in p.items()}
    v = {k: torch.zeros_like(t) for k, t in p.items()}
    for t in range(1, 4):
        lr = leaf * cosine(torch.tensor(t - 1, dtype=D))
        gs = torch.autograd.grad(smooth_loss(p, x, y), list(p.values()), create_graph=True)
        new = {}
        for k, g in zip(p, gs, strict=True):
            m[k] = 0.9 * m[k] + 0.1 * g
            v[k] = 0.999 * v[k] + 0.001 * g**2
            new[k] = p[k] - lr * (m[k] / (1 - 0.9**t)) / (torch.sqrt(v[k] / (1 - 0.999**t)) + 1e-8)
        p = new
    want = torch.autograd.grad(smooth_loss(p, x, y), leaf)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch's SDPA
def test_vmapped_ensemble_of_small_gpts_with_tied_weights():
    """Two copies of examples/char_gpt.py's model (tied embeddings, masked AdamW,
    per-block rule with atol, monitor) trained 3 steps in one vmapped fg.make_step,
    against each trained alone by the eager donated step."""
    from workers.shard_workers import small_gpt

    m, tx = small_gpt()

    def loss(p, idx, tgt):
        logits = fg.call(m, p, idx)
        return nn.functional.cross_entropy(logits.reshape(-1, 11), tgt.reshape(-1))

    base = fg.params(m)
    g = torch.Generator().manual_seed(5)
    members = [
        {k: v.clone() for k, v in base.items()},
        {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()},
    ]
    batches = [torch.randint(0, 11, (2, 4, 9), generator=g) for _ in range(3)]
    stacked = {k: torch.stack([p[k] for p in members]) for k in base}
    state = vmap(tx.init)(stacked)
    step = vmap(fg.make_step(loss, tx))
    for idx in batches:
        stacked, state, _ = step(stacked, state, idx[:, :, :-1], idx[:, :, 1:])
    alone = fg.make_step(loss, tx, donate=True)
    for i, p in enumerate(members):
        s = tx.init(p)
        for idx in batches:
            alone(p, s, idx[i, :, :-1], idx[i, :, 1:])
        assert_trees_close({k: v[i] for k, v in stacked.items()}, p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_vmapped_adam_equals_the_eager_fast_path_in_low_precision(dtype):
    """The per-tensor math that runs under vmap computes half precision in float32
    like the multi-tensor path: the same bits, 3 steps of AdamW with amsgrad."""
    tx = fg.adamw(lr=0.1, weight_decay=0.1, amsgrad=True)
    g0 = torch.Generator().manual_seed(1)
    p = {
        "a": torch.randn(3, 4, generator=g0).to(dtype),
        "b": torch.randn(5, generator=g0).to(dtype),
    }
    grads = [
        {k: torch.randn(v.shape, generator=g0).to(dtype) for k, v in p.items()} for _ in range(3)
    ]

    def run(p, *gs):
        s = tx.init(p)
        for g in gs:
            u, s = tx.update(g, s, p)
            p = fg.apply_updates(p, u)
        return p, s

    eager = run(p, *grads)
    batched = vmap(run)(
        {k: v.unsqueeze(0) for k, v in p.items()},
        *({k: v.unsqueeze(0) for k, v in g.items()} for g in grads),
    )
    assert_trees_close(torch.utils._pytree.tree_map(lambda t: t[0], batched), eager)
