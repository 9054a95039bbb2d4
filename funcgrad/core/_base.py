"""The core abstraction: a gradient transformation is a pair of pure functions.

Following optax, a transformation never mutates anything. ``init`` builds a state
pytree from the parameters, ``update`` maps ``(grads, state, params)`` to
``(updates, new_state)``. Optimizers are chains of such transformations, and the
caller adds the final updates to the parameters with :func:`apply_updates`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TypeGuard

import torch
from torch import Tensor

from ._compose import composing
from ._flat import Flat, pack
from ._tree import names_mismatch

Params = dict[str, Tensor]
"""Flat dict of tensors, keyed exactly as ``model.named_parameters()``."""

State = Any
"""A pytree of tensors (NamedTuples, tuples and dicts of tensors)."""

LossFn = Callable[..., Any]
"""``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``)."""


class Gradients(NamedTuple):
    """What a step's gradient function returns."""

    grads: Params
    loss: Tensor
    buffers: Any  # the buffers the forward updated (make_step(buffers=True)), else None
    aux: Any  # loss_fn's aux (has_aux=True), else None


class InitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class UpdateFn(Protocol):
    def __call__(
        self, grads: Params, state: State, params: Params | None = None
    ) -> tuple[Params, State]: ...


@dataclass(frozen=True)
class Facts:
    """What a transformation is, beside what it computes: carried on the
    :class:`GradientTransformation` object (as equinox keeps static fields), read
    by ``fg.sharded``, ``fg.Optimizer``, ``fg.grouped`` and ``fg.make_step``. It
    never changes what ``update`` computes. ``GradientTransformation(init, update)``
    built by hand has none of them (``NO_FACTS``): not even another transformation's
    whose functions it reuses."""

    shardable: bool = False
    """``fg.sharded`` may run it on row shards (see :func:`shardable`)."""
    by_entry: bool = False
    """It may also run on any cut of the flat buffers (``fg.sharded`` on ``fg.params``),
    where a piece is a 1-D run of entries."""
    averages: bool = False
    """It is or contains ``fg.all_reduce_mean`` (``fg.sharded``, which averages
    itself, refuses it)."""
    parts: tuple[Any, ...] = ()
    """The transformations it wraps (``chain``, ``partition``, ``accumulate``...)."""
    remake: Callable[[tuple[Any, ...]], Any] | None = None
    """The same wrapper over other parts (``fg.grouped`` swaps an optimizer inside)."""
    optimizer: Any = None
    """An optimizer's :class:`funcgrad.optim._hparams.OptimizerInfo`: its factory, the
    arguments it was built with, and the hyperparameters its state holds."""
    ghost: tuple[float, str] | None = None
    """Built by ``fg.ghost_clip(max_norm, reduction)``: ``fg.make_step(per_sample=)``
    computes it from per-sample gradient norms (funcgrad/step/_ghost.py)."""
    minimize: Callable[..., Any] | None = None
    """An optimizer that evaluates the loss itself (``fg.lbfgs``: its iterations and
    line search): ``minimize(evaluate, x, state) -> (x, state, first)`` on the flat
    parameter vector ``x``, where ``evaluate(x) -> (loss, flat_grad, result)``.
    ``fg.make_step`` and ``fg.Optimizer.step(closure)`` call it instead of ``update``
    (funcgrad/optim/_lbfgs.py)."""
    eager: Callable[..., Any] | None = None
    """``update``'s values by another road for an eager step on plain CPU tensors:
    ``eager(grads, state, params, scratch) -> (updates, state)``, or None where these
    inputs need ``update``. It may read tensors on the host (free on the CPU) to skip
    work ``update`` does on every entry, and borrow its large results from ``scratch``
    (a :class:`funcgrad.core._scratch.Scratch`, or None: allocate), which the caller
    reclaims once the step has read them. ``fg.Optimizer``'s step on torch's fused kernels
    calls it for the rules in front (funcgrad/optim/_fused.py); ``fg.per_group`` of
    ``fg.rules.zero_fix()`` has one (funcgrad/rules/_eager.py)."""


NO_FACTS = Facts()


class _Pair(NamedTuple):
    init: InitFn
    update: UpdateFn


class GradientTransformation(_Pair):
    """A pair of pure functions ``(init, update)``.

    ``init(params) -> state`` and ``update(grads, state, params=None) -> (updates,
    new_state)``. Neither mutates its inputs, so both can be traced by
    ``torch.compile(fullgraph=True)`` and composed with ``torch.func`` transforms.
    It unpacks and indexes as a pair (``init, update = tx``); ``tx.facts`` says what
    funcgrad knows of it (:class:`Facts`; none for one built by hand).

    Examples:
        >>> import torch, funcgrad as fg
        >>> double = fg.GradientTransformation(
        ...     init=lambda params: fg.EmptyState(),
        ...     update=lambda grads, state, params=None: (
        ...         {k: 2 * g for k, g in grads.items()}, state),
        ... )
        >>> updates, _ = double.update({"w": torch.ones(2)}, double.init({}))
        >>> updates["w"]
        tensor([2., 2.])
    """

    facts: Facts

    def __new__(
        cls, init: InitFn, update: UpdateFn, facts: Facts | None = None
    ) -> GradientTransformation:
        self = super().__new__(cls, init, update)
        self.facts = NO_FACTS if facts is None else facts
        return self


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def require_transformation(obj: object, what: str, example: str = "fg.adam()") -> None:
    """A TypeError unless ``obj`` is a :class:`GradientTransformation`: "``what`` must be
    a GradientTransformation (e.g. ``example``), got ``type``.", and where ``obj`` is a
    callable (a rule), how to make it one."""
    if isinstance(obj, GradientTransformation):
        return
    hint = (
        " A rule (a function of a group) becomes one with fg.per_group(rule, groups)."
        if callable(obj)
        else ""
    )
    raise TypeError(
        f"{what} must be a GradientTransformation (e.g. {example}), got {type(obj).__name__}.{hint}"
    )


def stateless(fn: Callable[[Params, Params | None], Params]) -> GradientTransformation:
    """Wrap ``fn(grads, params) -> updates`` as a transformation with an empty state.

    Examples:
        >>> import torch, funcgrad as fg
        >>> neg = fg.stateless(lambda grads, params: {k: -g for k, g in grads.items()})
        >>> neg.update({"w": torch.ones(1)}, neg.init({}))[0]
        {'w': tensor([-1.])}
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(grads: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        return fn(grads, params), state

    return GradientTransformation(init, update)


def identity() -> GradientTransformation:
    """A transformation that passes gradients through unchanged.

    Examples:
        >>> import torch, funcgrad as fg
        >>> fg.identity().update({"w": torch.ones(1)}, fg.EmptyState())[0]
        {'w': tensor([1.])}
    """
    return shardable(stateless(lambda grads, params: grads), by_entry=True)


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (for frozen partitions).

    Examples:
        >>> import torch, funcgrad as fg
        >>> fg.set_to_zero().update({"w": torch.ones(2)}, fg.EmptyState())[0]
        {'w': tensor([0., 0.])}
    """
    return shardable(
        stateless(lambda grads, params: {k: torch.zeros_like(g) for k, g in grads.items()}),
        by_entry=True,
    )


def clip_factor(max_norm: float | Tensor, norm: Tensor) -> Tensor:
    """``min(1, max_norm / (norm + 1e-6))``: what a gradient of 2-norm ``norm`` is
    scaled by to clip it to ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s formula;
    ``fg.rules.clip_norm`` and ``fg.ghost_clip`` both use it, so they agree)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def with_facts(tx: GradientTransformation, **changes: Any) -> GradientTransformation:
    """``tx`` (the same functions) with some of its :class:`Facts` changed."""
    return GradientTransformation(tx.init, tx.update, replace(tx.facts, **changes))


def shardable(
    tx: GradientTransformation,
    *parts: GradientTransformation,
    by_entry: bool = False,
    remake: Callable[[tuple[Any, ...]], Any] | None = None,
) -> GradientTransformation:
    """``tx`` declared to run on row shards under :func:`funcgrad.sharded` if all of
    ``parts`` (the transformations it wraps) may; ``remake(new_parts)`` builds the same
    wrapper over other parts. Returns a new transformation (the same functions).

    A transformation may when each output entry depends only on the same entry of
    the gradients, parameters and its own state, and on per-group statistics taken
    through ``funcgrad.rules._rule_base`` (which combine across ranks). ``by_entry=True``
    declares more: it does not read the tensors' shapes either (no factored moments,
    no matrix of its own, no mask or label decided from a shape), so it may run on
    equal chunks of the flat buffers, where each tensor's piece is a 1-D run of
    entries (if all of ``parts`` may too).
    """
    ok = all(p.facts.shardable for p in parts)
    return with_facts(
        tx,
        shardable=ok,
        by_entry=ok and by_entry and all(p.facts.by_entry for p in parts),
        averages=any(p.facts.averages for p in parts),
        parts=parts,
        remake=remake,
    )


def wrapping(
    tx: GradientTransformation,
    *parts: GradientTransformation,
    remake: Callable[[tuple[Any, ...]], Any] | None = None,
) -> GradientTransformation:
    """``tx`` recorded as wrapping ``parts`` (``remake`` builds it over others), without
    declaring it shardable."""
    return with_facts(tx, parts=parts, remake=remake, averages=any(p.facts.averages for p in parts))


def apply_updates(params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> Params:
    """Return ``params + updates`` entry by entry, as a new dict (pure).

    Each update is cast to its parameter's dtype, so a float32 update of a bfloat16
    parameter stays bfloat16.

    Examples:
        >>> import torch, funcgrad as fg
        >>> fg.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    if params.keys() != updates.keys():
        raise KeyError(
            "fg.apply_updates: params and updates must have the same names; updates have "
            f"{names_mismatch(params, updates)}. Pass the updates returned by "
            "tx.update(grads, state, params) for these same params."
        )
    if isinstance(params, Flat):  # flat params: the sum over each buffer, same layout
        layout = params.layout
        ps, us = list(params.buffers), updates_as_params(params, updates)
        if composing(*ps, *us):
            return Flat([p + u for p, u in zip(ps, us, strict=True)], layout)  # type: ignore[return-value]
        return Flat(torch._foreach_add(ps, us), layout)  # type: ignore[return-value]
    if not params or composing(params, updates):
        # Traced, or under torch.func / differentiating autograd: plain additions.
        return {k: p + updates[k].to(p.dtype) for k, p in params.items()}
    # Eagerly, one dispatch for all tensors (the same additions, bit for bit).
    new = torch._foreach_add(list(params.values()), updates_as_params(params, updates))
    return dict(zip(params, new, strict=True))


def in_dtype_of(u: Tensor, p: Tensor) -> Tensor:
    """``u`` in ``p``'s dtype; ``u`` itself where it has it (no call: eager overhead)."""
    return u if u.dtype == p.dtype else u.to(p.dtype)


def is_number(x: object) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool`` (``True`` is an ``int`` in Python)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def updates_as_params(params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> list[Tensor]:
    """The updates aligned with ``leaves(params)`` (a Flat's buffers, else its values),
    each cast to its parameter's dtype (no call where it already has it: eager
    overhead)."""
    if isinstance(params, Flat):
        packed = pack(updates, params.layout)
        return [in_dtype_of(u, p) for p, u in zip(params.buffers, packed.buffers, strict=True)]
    return [in_dtype_of(updates[k], p) for k, p in params.items()]


def describe(x: object) -> str:
    """``"(2, 3) torch.float32"`` for a tensor, else the type's name (for messages)."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def check_state(state: State, cls: type, who: str) -> None:
    """Raise a clear error unless ``state`` is the ``cls`` that ``who``'s init makes."""
    if not isinstance(state, cls):
        name = cls.__name__
        article = "an" if name[0] in "AEIOU" else "a"
        raise TypeError(
            f"{who}.update: expected {article} {name}, got {type(state).__name__}. Build "
            "the state with the same transformation's init(params)."
        )


def params_device(params: Mapping[str, Tensor]) -> torch.device:
    """Where a transformation keeps its counters, and ``fg.sharded`` its layout: with
    the (first) parameter; the CPU for no parameters."""
    return next(iter(params.values())).device if params else torch.device("cpu")


def check_floating(tree: Mapping[str, Tensor], what: str) -> None:
    """Raise a clear error unless every value is a real floating-point tensor."""
    for name, t in tree.items():
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{what}: '{name}' is a {type(t).__name__}, not a torch.Tensor. "
                "funcgrad works on flat dicts of tensors such as fg.params(model)."
            )
        if not torch.is_floating_point(t):
            raise TypeError(
                f"{what}: '{name}' has dtype {t.dtype}; gradients and optimizer "
                "states need a real floating-point dtype (float16/bfloat16/float32/"
                "float64). Integer tensors cannot be trained; complex parameters are "
                "not supported - store them as real pairs with torch.view_as_real."
            )
