"""``fg.Optimizer``'s eager step on torch's fused kernels.

An eager ``fg.Optimizer.step`` whose transformation is Adam, AdamW, SGD or Adagrad
(one per param group, as ``fg.grouped`` splits it), alone or at the end of a
``fg.chain`` of rules, updates the parameters and the optimizer's state in place with
``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` / ``_fused_adagrad_``: the kernels of
``torch.optim.Adam(fused=True)`` and its siblings, one pass over each parameter,
gradient and moment, no temporaries. The rules in front run functionally on the
gradients, by their ``Facts.eager`` form where they have one (``fg.per_group`` of
``fg.rules.zero_fix()``: one pass per gradient without zeros,
funcgrad/rules/_eager.py), their large results in the optimizer's scratch buffers.
The values are those of torch's fused optimizer with the same arguments, bit for
bit (``tests/test_fused_step.py``); torch's fused and default kernels differ by
rounding, and both stay within the tolerances the drop-in tests hold against
``torch.optim``'s default.

The step counter, the hyperparameters and their schedules stay in funcgrad's state
as on every other path: the kernel reads the step's values as Python floats (one
``tolist()`` per group), and the state's ``count`` and ``hyperparams`` advance as
the kernel path (funcgrad/optim/_kernel.py) advances them.

RMSprop, Adamax, NAdam, RAdam, Adadelta and Rprop take the same road onto torch's
foreach implementations, and ASGD onto funcgrad's own arithmetic in torch's in-place
multi-tensor ops (funcgrad/optim/_foreach.py), float32 and float64 only.

Anything else takes the general path: a traced step (``torch.compile(opt.step)``),
another optimizer, ``eps_root``, a tensor hyperparameter that carries a gradient,
DTensors, sparse or complex tensors, a device without fused kernels, or a state not
shaped as the parameters (:func:`plan` returns None; :func:`run` returns None where
a step's inputs do not fit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._compat import compiling, fused_adagrad, fused_adam, fused_sgd, tree_flatten
from ..core._base import GradientTransformation, State
from ..core._combine import ChainState, ParamGroupsState
from ..core._scratch import Scratch
from . import _foreach
from ._hparams import is_optimizer_state, mask_resolver, next_value, value64


@dataclass(frozen=True)
class _Group:
    tx: GradientTransformation
    names: tuple[str, ...]
    decays: Callable[[dict[str, Tensor]], dict[str, bool]]


@dataclass(frozen=True)
class Plan:
    """Where the optimizer states sit in the state, and each group's optimizer."""

    chained: bool  # the optimizer is the last of a chain or named_chain
    prefix: tuple[GradientTransformation, ...]  # the rules before it there
    groups: tuple[_Group, ...]
    grouped: bool  # the states are a ParamGroupsState's


def plan(full: GradientTransformation, state: State, names: Sequence[Sequence[str]]) -> Plan | None:
    """The fused plan for ``full`` with ``state``, its param groups' names in order;
    None where it has none."""
    prefix: tuple[GradientTransformation, ...] = ()
    opt, opt_state = full, state
    chained = _chained(state)
    if chained is not None:  # fg.chain or fg.named_chain: the optimizer last
        parts = full.facts.parts
        if not parts or len(parts) != len(chained):
            return None
        prefix, opt, opt_state = tuple(parts[:-1]), parts[-1], chained[-1]
    if is_optimizer_state(opt_state) and opt.facts.optimizer is not None:
        if len(names) != 1:
            return None
        txs, grouped = [opt], False
    elif isinstance(opt_state, ParamGroupsState):
        txs, grouped = list(opt.facts.parts), True
        if len(txs) != len(opt_state.inner_states) or len(txs) != len(names):
            return None
    else:
        return None
    groups = []
    for tx, group_names in zip(txs, names, strict=True):
        info = tx.facts.optimizer
        if info is None or info.who not in _KERNELS or not info.kwargs:
            return None
        if info.kwargs.get("eps_root", 0.0):
            return None
        decays = mask_resolver(info.kwargs.get("mask"), info.who)
        groups.append(_Group(tx, tuple(group_names), decays))
    return Plan(chained is not None, prefix, tuple(groups), grouped)


_KERNELS = ("fg.adam", "fg.adamw", "fg.sgd", "fg.adagrad", *_foreach.FOREACH)


def _chained(state: State) -> list[State] | None:
    """The inner states of a ``chain``'s (a ``ChainState``) or ``named_chain``'s (a dict
    by name, in order) state, else None."""
    if isinstance(state, ChainState):
        return list(state.inner_states)
    if type(state) is dict and state:
        return list(state.values())
    return None


def _rechained(state: State, inner: list[State]) -> State:
    if isinstance(state, ChainState):
        return ChainState(tuple(inner))
    return dict(zip(state, inner, strict=True))


def run(
    p: Plan,
    state: State,
    params: dict[str, Tensor],
    grads: dict[str, Tensor],
    scratch: Scratch | None = None,
) -> State | None:
    """One step on the fused kernels: the parameters and the moments in place; the new
    state (the same tensors, the count and hyperparameters advanced), or None where
    this step cannot run fused (nothing has been written then). The rules in front
    borrow their large results from ``scratch`` (the optimizer's own, taken back
    when the step returns)."""
    if compiling() or not params:
        return None
    try:
        return _run(p, state, params, grads, scratch)
    finally:
        if scratch is not None:
            scratch.reclaim()  # the kernels have read the rules' results


def _run(
    p: Plan,
    state: State,
    params: dict[str, Tensor],
    grads: dict[str, Tensor],
    scratch: Scratch | None,
) -> State | None:
    chained = _chained(state) if p.chained else None
    opt_state = chained[-1] if chained is not None else state
    states = list(opt_state.inner_states) if p.grouped else [opt_state]
    calls = []
    for g, s in zip(p.groups, states, strict=True):
        call = _prepare(g, s, params, None if chained is not None else grads)
        if call is None:
            return None
        calls.append(call)
    prefix_states: list[State] = []
    if chained is not None:
        for tx, s in zip(p.prefix, chained[:-1], strict=True):
            # a rule's host-read form where it has one (Facts.eager), else its update
            eager = tx.facts.eager
            done = eager(grads, s, params, scratch) if eager is not None else None
            grads, s = done if done is not None else tx.update(grads, s, params)
            prefix_states.append(s)
        if scratch is not None and scratch.lent:
            kept = {id(t) for t in tree_flatten(prefix_states)[0]}
            if any(id(t) in kept for t in scratch.lent):
                scratch.forget()  # a state holds a rule's result: never lend it again
        if not all(_fits(grads[n], params[n]) for n in params):
            return None  # a rule changed the gradients' dtype or shape: the general path
    new = [
        _step(g, s, call, params, grads) for g, s, call in zip(p.groups, states, calls, strict=True)
    ]
    inner = ParamGroupsState(tuple(new)) if p.grouped else new[0]
    return _rechained(state, [*prefix_states, inner]) if chained is not None else inner


_PLAIN = (Tensor, torch.nn.Parameter)


def _fits(t: Any, p: Tensor) -> bool:
    """``t`` (a gradient or a moment) is a plain dense tensor shaped and typed as ``p``."""
    return (
        type(t) is Tensor
        and t.dtype is p.dtype
        and t.shape == p.shape
        and t.device == p.device
        and t.layout is torch.strided
        and not t.requires_grad
    )


def _slots(who: str, kwargs: Mapping[str, Any], s: Any) -> list[str]:
    if who in _foreach.FOREACH:
        return _foreach.FOREACH[who].slots(kwargs, s.hyperparams)
    if who == "fg.sgd":
        return ["momentum_buffer"] if "momentum" in s.hyperparams else []
    if who == "fg.adagrad":
        return ["sum"]
    return ["mu", "nu", "nu_max"] if kwargs.get("amsgrad") else ["mu", "nu"]


def _prepare(
    g: _Group, s: Any, params: Mapping[str, Tensor], grads: Mapping[str, Tensor] | None
) -> tuple[Any, ...] | None:
    """The group's slot tensors by name and its names by (device, dtype, decays), or
    None where the state, the parameters or the gradients (where given) do not fit the
    fused kernels."""
    info = g.tx.facts.optimizer
    if (
        not is_optimizer_state(s)
        or s.hyperparams is None
        or s.hyperparams.keys() != info.hyper.keys()
    ):
        return None
    fields = _slots(info.who, info.kwargs, s)
    slots = [getattr(s, f) for f in fields]
    names = set(g.names)
    for t in slots:
        if type(t) is not dict or t.keys() != names:
            return None
    hp = _leaves(s.hyperparams)
    if any(t.requires_grad for t in hp) or s.count.device != params[g.names[0]].device:
        return None
    foreach = _foreach.FOREACH.get(info.who)
    # funcgrad computes float16/bfloat16 in float32, torch's foreach does not
    dtypes = _foreach.DTYPES if foreach is not None else None
    for f in foreach.carried if foreach is not None else ():
        c = getattr(s, f)
        if not isinstance(c, Tensor) or c.dim() != 0 or c.requires_grad:
            return None
    if foreach is not None and not _foreach.fits(info.who, s):
        return None
    decay = g.decays({n: params[n] for n in g.names}) if "weight_decay" in s.hyperparams else {}
    buckets: dict[tuple[torch.device, torch.dtype, bool], list[str]] = {}
    for n in g.names:
        p = params[n]
        if (
            type(p) not in _PLAIN  # no DTensor or other subclass
            or not (p.is_cpu or p.is_cuda)  # fused kernels
            or not p.is_floating_point()
            or p.layout != torch.strided
            or (dtypes is not None and p.dtype not in dtypes)
            or (grads is not None and not _fits(grads[n], p))
        ):
            return None
        for t in slots:
            if not _fits(t[n], p):
                return None
        buckets.setdefault((p.device, p.dtype, decay.get(n, False)), []).append(n)
    return slots, buckets


def _leaves(hp: Mapping[str, Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for v in hp.values():
        out.extend(v if isinstance(v, tuple) else (v,))
    return out


def _step(
    g: _Group,
    s: Any,
    call: tuple[Any, ...],
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
) -> Any:
    info = g.tx.facts.optimizer
    kwargs = info.kwargs
    slots, buckets = call
    count = s.count + 1
    hp = {k: value64(v, count) for k, v in s.hyperparams.items()}
    values = torch.stack([*_leaves(hp), s.count.to(torch.float64)]).tolist()
    first = values.pop() == 0
    read = iter(values)
    v: dict[str, Any] = {
        k: tuple(next(read) for _ in e) if isinstance(e, tuple) else next(read)
        for k, e in hp.items()
    }
    wd = v.get("weight_decay", 0.0)
    foreach = _foreach.FOREACH.get(info.who)
    fields = foreach.carried if foreach is not None else ()
    before = [getattr(s, f) for f in fields]  # every bucket starts from the state's
    carried: dict[str, Tensor] = {}
    steps: dict[torch.device, Tensor] = {}
    for (device, _, decays), names in buckets.items():
        ps = [params[n] for n in names]
        gs = [grads[n] for n in names]
        ss = [[slot[n] for n in names] for slot in slots]
        w = wd if decays else 0.0
        if foreach is not None:  # the carried values come out equal from every bucket
            new = _foreach.step(info.who, ps, gs, ss, before, s.count, v, kwargs, w)
            carried = dict(zip(fields, new, strict=True))
            continue
        if info.who == "fg.sgd":
            momentum = v.get("momentum", 0.0)  # 0.0 written to a group: plain SGD, as torch
            fused_sgd(
                ps, gs, ss[0] if ss and momentum != 0.0 else [],
                weight_decay=w, momentum=momentum, lr=v["lr"],
                dampening=v.get("dampening", 0.0), nesterov=bool(kwargs.get("nesterov")),
                maximize=bool(kwargs.get("maximize")), is_first_step=first,
            )  # fmt: skip
            continue
        if device not in steps:
            steps[device] = count.to(device=device, dtype=torch.float32)
        if info.who == "fg.adagrad":
            fused_adagrad(
                ps, gs, ss[0], [steps[device]] * len(ps), lr=v["lr"], lr_decay=v["lr_decay"],
                weight_decay=w, eps=v["eps"], maximize=bool(kwargs.get("maximize")),
            )  # fmt: skip
            continue
        decoupled = info.who == "fg.adamw" or bool(kwargs.get("decoupled_weight_decay"))
        b1, b2 = v["betas"]
        fused_adam(
            ps, gs, ss[0], ss[1], ss[2] if len(ss) > 2 else [], [steps[device]] * len(ps),
            lr=v["lr"], beta1=b1, beta2=b2, weight_decay=w, eps=v["eps"],
            amsgrad=bool(kwargs.get("amsgrad")), maximize=bool(kwargs.get("maximize")),
            decoupled=decoupled,
        )  # fmt: skip
    after = {k: next_value(info.hyper[k], e, count) for k, e in s.hyperparams.items()}
    return s._replace(count=count, hyperparams=after, **carried)


__all__ = ["Plan", "plan", "run"]
