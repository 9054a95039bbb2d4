"""Functional Adam and AdamW, step-for-step equal to ``torch.optim.Adam`` / ``AdamW``.

The update math is in :func:`adam`'s docstring (rendered on the API site)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core import _flat as flat
from ..core._base import (
    GradientTransformation,
    Params,
    check_floating,
    check_state,
    has_lr,
    params_device,
    shardable,
)
from ..core._compose import composing
from ..core._fusion import realize
from ..core._invariants import invariants
from ..core._scratch import BIG, Scratch, borrowing
from ._hparams import (
    DecayMask,
    Hyper,
    LearningRate,
    as64,
    check_lr,
    check_number,
    check_weight_decay,
    compute_dtype,
    lr_now,
    lr_start,
    mask_resolver,
    nonzero,
)
from ._kernel import decay_per_buffer


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`.

    ``count``: int64 0-d tensor, steps taken. ``mu``/``nu``: first and second moments.
    ``nu_max``: running max of ``nu`` (``amsgrad``), else an empty dict.
    """

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: dict[str, Tensor]
    nu: dict[str, Tensor]
    nu_max: dict[str, Tensor]
    lr: Any = None  # float64 0-d: the learning rate, or its factor (_hparams.lr_start)


invariants(
    AdamState,
    count="nonnegative",
    mu="finite",
    nu="finite nonnegative",
    nu_max="finite nonnegative",
    lr="finite nonnegative",
)


def _bias_scalars(count: Tensor, lr: Tensor, b1: Hyper, b2: Hyper) -> Tensor:
    """``[lr / (1 - b1^t), 1 / sqrt(1 - b2^t)]`` in float64 for ``t = count``, as torch
    computes them in Python doubles."""
    t = count.to(torch.float64)
    bc1 = 1.0 - torch.pow(as64(b1, t), t)
    bc2 = 1.0 - torch.pow(as64(b2, t), t)
    return realize(torch.stack([lr / bc1, 1.0 / torch.sqrt(bc2)]))


def _check_hparams(
    lr: LearningRate,
    betas: tuple[Hyper, Hyper],
    eps: Hyper,
    weight_decay: Hyper,
    eps_root: float,
) -> None:
    check_lr(lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2).")
    for i, b in enumerate(betas):
        check_number(
            b,
            f"beta parameter at index {i}",
            lambda v: 0.0 <= v < 1.0,
            f"Invalid beta parameter at index {i}: {{}}",
            "beta",
        )
    check_number(eps, "epsilon value", lambda v: v >= 0.0, "Invalid epsilon value: {}")
    check_weight_decay(weight_decay)
    if isinstance(eps_root, bool) or not isinstance(eps_root, (int, float)) or not eps_root >= 0:
        raise ValueError(f"Invalid eps_root value: {eps_root!r}; expected a float >= 0.")


class _Hyper(NamedTuple):
    b1: Hyper
    b2: Hyper
    eps: Hyper
    weight_decay: Hyper
    amsgrad: bool
    maximize: bool
    decoupled: bool
    eps_root: float


def _adam(
    lr: LearningRate,
    betas: tuple[Hyper, Hyper],
    eps: Hyper,
    weight_decay: Hyper,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    mask: DecayMask,
    eps_root: float,
) -> GradientTransformation:
    _check_hparams(lr, betas, eps, weight_decay, eps_root)
    name = "adamw" if decoupled else "adam"
    b1, b2, eps_, wd = (
        x if isinstance(x, Tensor) else float(x) for x in (*betas, eps, weight_decay)
    )
    hp = _Hyper(b1, b2, eps_, wd, amsgrad, maximize, decoupled, float(eps_root))
    has_decay = nonzero(hp.weight_decay)
    # The multi-tensor path takes Python floats only; tensor hyperparameters and
    # eps_root always run the per-tensor math.
    foreach_ok = eps_root == 0.0 and not any(
        isinstance(x, Tensor) for x in (hp.b1, hp.b2, hp.eps, hp.weight_decay)
    )
    decays = mask_resolver(mask, f"fg.{name}")

    def init(params: Params) -> AdamState:
        check_floating(params, f"fg.{name}.init")
        decays(params)  # a mask for other parameters fails here, not at the first step
        count = torch.zeros((), dtype=torch.int64, device=params_device(params))
        return AdamState(
            count=count,
            # fg.params(model)'s flat layout gives flat moments (funcgrad/core/_flat.py)
            mu=flat.zeros_like(params),
            nu=flat.zeros_like(params),
            nu_max=flat.zeros_like(params) if amsgrad else {},
            lr=lr_start(lr, count),  # the learning rate is state: fg.Optimizer writes it
        )

    def update(
        grads: Params, state: AdamState, params: Params | None = None
    ) -> tuple[Params, AdamState]:
        check_state(state, AdamState, f"fg.{name}")
        if state.mu.keys() != grads.keys() or bool(state.nu_max) != amsgrad:
            raise KeyError(
                f"fg.{name}.update: the state was made for parameters {sorted(state.mu)}"
                f"{' (with amsgrad)' if state.nu_max else ''}, but the gradients are for "
                f"{sorted(grads)}{' (with amsgrad)' if amsgrad else ''}. Was the state "
                "built by another transformation or for another model?"
            )
        if has_decay and params is None:
            raise ValueError(
                f"fg.{name}(weight_decay={weight_decay}) needs the parameters: call "
                "tx.update(grads, state, params)."
            )
        decay = decays(params) if has_decay and params is not None else {}
        count = state.count + 1
        # Schedules see the steps taken so far as a float64 0-d tensor, so that
        # arithmetic like 1 / (1 + count) stays in double precision, like torch's lr.
        lr_t = lr_now(lr, state.lr, state.count)
        scalars = _bias_scalars(count, lr_t, hp.b1, hp.b2)
        step_size, inv_bc2_sqrt = scalars[0], scalars[1]
        lr_decay = lr_t * hp.weight_decay
        mu: Any = state.mu
        layout = mu.layout if isinstance(mu, flat.Flat) else None
        if layout is not None:  # flat moments: the same math over whole buffers
            grads = flat.pack(grads, layout)
            params = None if params is None else flat.pack(params, layout)
        # Eagerly: the same operations on lists of tensors (torch._foreach_*), one
        # dispatch per operation and dtype instead of one per tensor.
        multi = foreach_ok and not composing(
            *_leaves(grads, params, state.mu, state.nu, state.nu_max), lr_t
        )
        path = _multi_tensor_adam if multi else _single_tensor_adam
        per_step: tuple[Any, ...] = (-step_size, inv_bc2_sqrt, lr_decay, hp)
        by_buffer = decay_per_buffer(decay, layout) if layout is not None else None
        if layout is None or by_buffer is None:  # per tensor (a mask splits a buffer: views)
            args = (grads, state, params, decay)
            out: tuple[Any, ...] = path(*(args if layout is None else _as_views(*args)), *per_step)
            if layout is not None:
                out = tuple(flat.pack(o, layout) if o else o for o in out)
            return out[0], AdamState(count, out[1], out[2], out[3], lr=state.lr)
        wrapped = AdamState(
            state.count,
            *(flat.by_buffer(t) if t else {} for t in (state.mu, state.nu, state.nu_max)),
        )
        out = path(
            flat.by_buffer(grads),
            wrapped,
            None if params is None else flat.by_buffer(params),
            by_buffer,
            *per_step,
        )
        back = tuple(flat.from_buffers(o, layout) if o else {} for o in out)
        return back[0], AdamState(count, back[1], back[2], back[3], lr=state.lr)

    # by_entry: a mask given as a predicate decides from shapes, which a flat chunk's
    # pieces do not keep (fg.sharded then splits by rows)
    return shardable(has_lr(GradientTransformation(init, update), lr), by_entry=not callable(mask))


def _leaves(*trees: Mapping[str, Tensor] | None) -> list[Tensor]:
    return [t for tree in trees if tree is not None for t in flat.leaves(tree)]


def _as_views(
    grads: Params, state: AdamState, params: Params | None, decay: Mapping[str, bool]
) -> tuple[Params, AdamState, Params | None, Mapping[str, bool]]:
    """Flat arguments as per-name views (plain dicts), for the per-tensor paths."""

    def views(t: Params) -> Params:
        return t.views() if isinstance(t, flat.Flat) else t

    wrapped = AdamState(state.count, views(state.mu), views(state.nu), views(state.nu_max))
    return views(grads), wrapped, None if params is None else views(params), decay


def _single_tensor_adam(
    grads: Params,
    state: AdamState,
    params: Params | None,
    decay: Mapping[str, bool],
    neg_step64: Tensor,
    inv_bc2_64: Tensor,
    lr_decay64: Tensor,
    hp: _Hyper,
) -> tuple[Params, Params, Params, Params]:
    """Adam tensor by tensor, without in-place ops: what ``torch.compile`` traces, and
    what runs under ``torch.func`` transforms and differentiating autograd (where the
    multi-tensor path would give wrong derivatives or no batching rule):
    ``(updates, mu, nu, nu_max)``."""
    b1, b2, wd = hp.b1, hp.b2, hp.weight_decay
    # The step's scalars in each compute dtype, converted once per dtype.
    per_dtype: dict[torch.dtype, tuple[Tensor, ...]] = {}
    updates: Params = {}
    mu: Params = {}
    nu: Params = {}
    nu_max: Params = {}
    for k, g in grads.items():
        # torch's "opmath": half-precision tensors are computed in float32 and
        # only stored in their own dtype (g * g overflows float16 at |g| > 256).
        sdt = state.mu[k].dtype
        dt = compute_dtype(sdt)
        if dt not in per_dtype:
            per_dtype[dt] = (neg_step64.to(dt), inv_bc2_64.to(dt), lr_decay64.to(dt))
        neg_step, inv_bc2, lr_wd = per_dtype[dt]
        # Tensor hyperparameters in the compute dtype; floats stay Python floats, so
        # the ops are those of the multi-tensor path, bit for bit.
        c1, c2, b2_, w, e = (
            x.to(dt) if isinstance(x, Tensor) else x for x in (1.0 - b1, 1.0 - b2, b2, wd, hp.eps)
        )
        g = g.to(dt)
        if hp.maximize:
            g = -g
        if decay.get(k, False) and not hp.decoupled:
            assert params is not None
            g = g + w * params[k].to(dt)
        m = torch.lerp(state.mu[k].to(dt), g, c1)
        # (1 - b2) * g first, then * g: no overflow where torch has none (its addcmul
        # computes value * t1 * t2 in that order), and not addcmul itself, whose
        # decomposition under torch.compile rounds differently from eager.
        v = state.nu[k].to(dt) * b2_ + (c2 * g) * g
        # Stored in the parameter's dtype; this step goes on with the float32 values
        # (torch re-reads its rounded float16 copies: a second moment below 6e-8
        # then reads as 0, and its update becomes inf/NaN where this one is finite).
        mu[k], nu[k] = m.to(sdt), v.to(sdt)
        if hp.amsgrad:
            v = torch.maximum(state.nu_max[k].to(dt), v)
            nu_max[k] = v.to(sdt)
        # One division per element, not two: sqrt(v) * (1 / sqrt(bc2)) differs from
        # torch's sqrt(v) / sqrt(bc2) by at most an ulp. With eps_root (optax's), the
        # root of v / bc2 + eps_root: differentiable where v == 0.
        if hp.eps_root:
            denom = torch.sqrt(v * (inv_bc2 * inv_bc2) + hp.eps_root) + e
        else:
            denom = torch.sqrt(v) * inv_bc2 + e
        u = torch.div(m, denom) * neg_step
        if decay.get(k, False) and hp.decoupled:
            assert params is not None
            u = u - lr_wd * params[k].to(dt)
        updates[k] = u
    return updates, mu, nu, nu_max


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, without the call when it would return ``t`` (eager overhead)."""
    return t if t.dtype == dtype else t.to(dtype)


def _multi_tensor_adam(
    grads: Params,
    state: AdamState,
    params: Params | None,
    decay: Mapping[str, bool],
    neg_step64: Tensor,
    inv_bc2_64: Tensor,
    lr_decay64: Tensor,
    hp: _Hyper,
) -> tuple[Params, Params, Params, Params]:
    """The per-tensor loop of ``update``, as ``torch._foreach_*`` over each dtype's
    tensors: the same operations in the same order, so the same values bit for bit
    (tested against the per-tensor loop, which is what ``torch.compile`` traces)."""
    fe = torch
    b1, b2, eps, l2_wd = (float(x) for x in (hp.b1, hp.b2, hp.eps, hp.weight_decay))  # floats here
    by_dtype: dict[torch.dtype, list[str]] = {}
    pooled: list[tuple[str, Scratch]] = []  # large CPU tensors, donated eager step
    for k, grad in grads.items():
        scratch = borrowing(grad) if grad.numel() >= BIG else None
        if scratch is not None:
            pooled.append((k, scratch))
        else:
            by_dtype.setdefault(state.mu[k].dtype, []).append(k)
    updates: Params = {}
    mu: Params = {}
    nu: Params = {}
    nu_max: Params = {}
    for k, scratch in pooled:
        out = _borrowed_adam(
            scratch, grads[k], state, k, params, decay.get(k, False), neg_step64, inv_bc2_64,
            lr_decay64, hp,
        )  # fmt: skip
        updates[k], mu[k], nu[k] = out[:3]
        if hp.amsgrad:
            nu_max[k] = out[3]
    for sdt, keys in by_dtype.items():
        dt = compute_dtype(sdt)
        neg_step, inv_bc2, lr_decay = _to(neg_step64, dt), _to(inv_bc2_64, dt), _to(lr_decay64, dt)
        g = [_to(grads[k], dt) for k in keys]
        if hp.maximize:
            g = list(fe._foreach_neg(g))
        l2 = [i for i, k in enumerate(keys) if decay.get(k, False)]
        if l2 and not hp.decoupled:
            assert params is not None
            wd = fe._foreach_mul([params[keys[i]].to(dt) for i in l2], l2_wd)
            for i, new in zip(l2, fe._foreach_add([g[i] for i in l2], wd), strict=True):
                g[i] = new
        m = fe._foreach_lerp([_to(state.mu[k], dt) for k in keys], g, 1.0 - b1)
        v = fe._foreach_mul([_to(state.nu[k], dt) for k in keys], b2)
        sq = fe._foreach_mul(g, 1.0 - b2)
        fe._foreach_mul_(sq, g)
        fe._foreach_add_(v, sq)
        for k, mk, vk in zip(keys, m, v, strict=True):
            mu[k], nu[k] = _to(mk, sdt), _to(vk, sdt)
        if hp.amsgrad:
            v = fe._foreach_maximum([_to(state.nu_max[k], dt) for k in keys], v)
            for k, vk in zip(keys, v, strict=True):
                nu_max[k] = _to(vk, sdt)
        denom = fe._foreach_sqrt(v)
        fe._foreach_mul_(denom, inv_bc2)
        fe._foreach_add_(denom, eps)
        u = fe._foreach_div(m, denom)
        fe._foreach_mul_(u, neg_step)
        if l2 and hp.decoupled:
            assert params is not None
            wd = fe._foreach_mul([params[keys[i]].to(dt) for i in l2], lr_decay)
            fe._foreach_sub_([u[i] for i in l2], wd)
        updates.update(zip(keys, u, strict=True))
    order = list(grads)
    return (
        {k: updates[k] for k in order},
        {k: mu[k] for k in order},
        {k: nu[k] for k in order},
        {k: nu_max[k] for k in order} if hp.amsgrad else {},
    )


def _borrowed_adam(
    scratch: Scratch,
    grad: Tensor,
    state: AdamState,
    k: str,
    params: Params | None,
    decays: bool,
    neg_step64: Tensor,
    inv_bc2_64: Tensor,
    lr_decay64: Tensor,
    hp: _Hyper,
) -> tuple[Tensor, ...]:
    """One tensor of :func:`_multi_tensor_adam`, the same operations in the same order, each
    writing into a buffer borrowed from ``scratch`` (``out=``) instead of a new one:
    ``(update, mu, nu[, nu_max])``."""
    sdt = state.mu[k].dtype
    dt = compute_dtype(sdt)
    b1, b2, eps, l2_wd = (float(x) for x in (hp.b1, hp.b2, hp.eps, hp.weight_decay))
    g = _to(grad, dt)
    if hp.maximize:
        g = torch.neg(g, out=scratch.take(g, dt))
    if decays and not hp.decoupled:
        assert params is not None
        wd = torch.mul(params[k].to(dt), l2_wd, out=scratch.take(g, dt))
        g = torch.add(g, wd, out=scratch.take(g, dt))
    m = torch.lerp(_to(state.mu[k], dt), g, 1.0 - b1, out=scratch.take(g, dt))
    v = torch.mul(_to(state.nu[k], dt), b2, out=scratch.take(g, dt))
    sq = torch.mul(g, 1.0 - b2, out=scratch.take(g, dt))
    sq.mul_(g)
    v.add_(sq)
    out: tuple[Tensor, ...] = (_to(m, sdt), _to(v, sdt))
    if hp.amsgrad:
        v = torch.maximum(_to(state.nu_max[k], dt), v, out=scratch.take(g, dt))
        out += (_to(v, sdt),)
    denom = torch.sqrt(v, out=sq)  # sq is not read again
    denom.mul_(_to(inv_bc2_64, dt)).add_(eps)
    u = torch.div(m, denom, out=scratch.take(g, dt))
    u.mul_(_to(neg_step64, dt))
    if decays and hp.decoupled:
        assert params is not None
        u.sub_(torch.mul(params[k].to(dt), _to(lr_decay64, dt), out=denom))
    return (u, *out)


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: DecayMask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    r"""Adam, equal step for step to ``torch.optim.Adam`` with the same arguments.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based)::

        g_t  <- -g_t                               if maximize
        g_t  <- g_t + wd * p                       Adam (L2), if wd != 0
        m_t   = lerp(m_{t-1}, g_t, 1 - b1)         = b1 m + (1 - b1) g
        v_t   = b2 v_{t-1} + (1 - b2) g_t^2
        v^_t  = max(v^_{t-1}, v_t)                 if amsgrad, else v_t
        u_t   = -lr / (1 - b1^t) * m_t / (sqrt(v^_t) * (1 / sqrt(1 - b2^t)) + eps)
        u_t  <- u_t - lr * wd * p                  AdamW (decoupled), if wd != 0

    With ``eps_root > 0`` (opt-in; off, it is torch's rule) the denominator is
    ``sqrt(v^_t / (1 - b2^t) + eps_root) + eps``, differentiable where ``v^_t == 0``.

    The step counter is an int64 0-d tensor and the bias corrections are computed in
    float64 (as torch does in Python doubles), then cast to the compute dtype: no
    recompiles as the step grows, and no drift from ``torch.optim``. float16 and bfloat16
    parameters are computed in float32 and their moments stored in their own dtype
    (torch's opmath); the update is float32 and ``apply_updates`` rounds it once. Within a
    step the float32 moments are used (torch re-reads the rounded ones), so a float16
    second moment that underflows gives a finite update here and inf/NaN in torch.

    ``weight_decay`` is the L2 penalty added to the gradient (as in torch); see
    :func:`adamw` for decoupled decay. ``mask`` says where weight decay applies (see
    ``DecayMask``): with a mask, equal to
    ``torch.optim.Adam`` with a decay and a no-decay param group.

    Differentiable and vmappable (meta-learning, ensembles): ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` may be 0-d tensors that carry gradients, and under
    ``torch.func.grad``/``vmap`` (or autograd recording through it) the update takes
    its plain per-tensor math. ``sqrt(nu)`` has no derivative where ``nu == 0`` (an
    exact-zero gradient on the first step): a derivative through such an entry is
    NaN, as in any Adam. ``eps_root > 0`` (optax's) takes the root of
    ``nu_hat + eps_root`` instead, finite there; it changes the update, so it is off
    by default (equal to ``torch.optim``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates), int(state.count)
        ({'w': tensor([ 0.9000, -0.9000])}, 1)

        A learnable lr: the derivative of the new ``w[0]`` (``1 - lr``) with respect to it:

        >>> def new_w0(lr):
        ...     tx = fg.adam(lr=lr)
        ...     u, _ = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        ...     return fg.apply_updates(params, u)["w"][0]
        >>> round(float(torch.func.grad(new_w0)(torch.tensor(0.1))), 4)
        -1.0
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, False, mask, eps_root)


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: DecayMask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    """AdamW, equal step for step to ``torch.optim.AdamW`` with the same arguments.

    Decoupled weight decay: ``p <- p - lr * weight_decay * p`` besides the Adam step,
    only where ``mask`` says so (e.g. ``mask=lambda name, p: p.ndim > 1`` keeps decay
    off biases and norm weights): equal to ``torch.optim.AdamW`` with a decay and a
    no-decay param group. Tensor hyperparameters and ``eps_root``: see :func:`adam`.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)  # 1 - 0.1 * 0.5 * 1 - 0.1
        {'w': tensor([0.8500])}
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, True, mask, eps_root)
