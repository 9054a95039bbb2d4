"""Hyperparameters shared by funcgrad's optimizers: learning rates (floats, 0-d
tensors, schedules), checks with torch-style messages, weight-decay masks, and the
compute dtype (torch's "opmath": float16/bfloat16 are computed in float32)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Union

import torch
from torch import Tensor

from ..core._base import Params
from ..core._compose import plain_value
from ..core._tree import names_mismatch

LearningRate = Union[float, Tensor, Callable[[Tensor], Union[float, Tensor]]]
"""A float, a 0-d tensor (edit it in place to change lr without recompiling; use
float64 to match torch.optim exactly, since float32 cannot hold 0.02), or a schedule
``count -> lr`` where ``count`` is the number of steps already taken, as a float64
0-d tensor (0 on the first step, like ``LambdaLR``'s epoch)."""


Hyper = Union[float, Tensor]
"""A hyperparameter: a float, or a 0-d tensor (learnable: gradients flow into it
when the update is differentiated, see funcgrad/core/_compose.py)."""


def as64(x: Hyper, like: Tensor) -> Tensor:
    """A hyperparameter as a float64 0-d tensor beside ``like`` (a float becomes a
    constant; a tensor keeps its autograd history)."""
    if isinstance(x, Tensor):
        return x.to(device=like.device, dtype=torch.float64)
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def check_number(
    x: Hyper, what: str, ok: Callable[[float], bool], message: str, short: str = ""
) -> None:
    """Validate a float or 0-d tensor hyperparameter; a tensor's value is checked
    where it can be read (not while compiled or under ``vmap``)."""
    if isinstance(x, Tensor):
        short = short or what
        if x.dim() != 0:
            raise ValueError(
                f"Invalid {what}: a tensor {short} must be 0-d, got shape {tuple(x.shape)}."
            )
        if not torch.is_floating_point(x):
            raise TypeError(
                f"Invalid {what}: a tensor {short} must be floating point (float64 "
                f"matches torch.optim exactly), got {x.dtype}."
            )
        value = plain_value(x)
        if value is not None and not ok(value):
            raise ValueError(message.format(value))
        return
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"Invalid {what}: {x!r}. Use a float or a 0-d tensor.")
    if not ok(x):
        raise ValueError(message.format(x))


HALF = (torch.float16, torch.bfloat16)

DecayMask = Union[Mapping[str, bool], Callable[[str, Tensor], bool], None]
"""Where weight decay applies: ``None`` (everywhere), a dict ``name -> bool`` naming
every parameter, or a predicate ``(name, tensor) -> bool`` (e.g. ``lambda n, p:
p.ndim > 1``: no decay on biases and norm weights)."""


def mask_resolver(mask: DecayMask, who: str) -> Callable[[Params], dict[str, bool]]:
    """Check ``mask`` now; return a function ``params -> {name: decays}``."""
    if mask is None:
        return lambda params: dict.fromkeys(params, True)
    if isinstance(mask, Mapping):
        bad = {k: v for k, v in mask.items() if not isinstance(v, bool)}
        if bad:
            raise TypeError(f"{who}: mask values must be bool, got {bad!r}.")

        def from_dict(params: Params) -> dict[str, bool]:
            if mask.keys() != params.keys():
                raise KeyError(
                    f"{who}: the mask must name every parameter exactly; it has "
                    f"{names_mismatch(params, mask)}. Build it from fg.params(model), or "
                    "pass a predicate (name, tensor) -> bool."
                )
            return {k: mask[k] for k in params}

        return from_dict
    if callable(mask):

        def from_predicate(params: Params) -> dict[str, bool]:
            out = {k: mask(k, p) for k, p in params.items()}
            bad = {k: type(v).__name__ for k, v in out.items() if not isinstance(v, bool)}
            if bad:
                raise TypeError(
                    f"{who}: the mask predicate must return a Python bool for each "
                    f"parameter (decided from names and shapes, not values); got {bad}."
                )
            return out

        return from_predicate
    raise TypeError(
        f"{who}: mask must be None, a dict name -> bool or a predicate (name, tensor) -> "
        f"bool, got {type(mask).__name__}."
    )


def check_lr(lr: LearningRate) -> None:
    """Validate a learning rate: a float >= 0, a 0-d floating tensor, or a schedule."""
    if isinstance(lr, Tensor):
        check_number(lr, "learning rate", lambda v: v >= 0.0, "Invalid learning rate: {}", "lr")
    elif callable(lr):
        pass
    elif isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(
            f"Invalid learning rate: {lr!r}. Use a float, a 0-d tensor, or a schedule "
            "count -> lr (e.g. fg.cosine_decay(1e-3, 1000))."
        )
    elif not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")


def lr_start(lr: LearningRate, like: Tensor) -> Tensor:
    """An optimizer state's ``lr`` field as :func:`init` makes it, a float64 0-d tensor
    beside ``like``: a float learning rate itself (the state then *is* the learning
    rate, as optax's ``inject_hyperparams`` keeps it), 1.0 for a 0-d tensor or a
    schedule (the state then holds a factor that multiplies it). ``fg.Optimizer``
    writes its param group's lr into its own state's field; nothing is written into
    ``tx``, so one ``tx`` may serve any number of optimizers, steps and ranks."""
    value = 1.0 if isinstance(lr, Tensor) or callable(lr) else float(lr)
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def lr_now(lr: LearningRate, state_lr: Tensor | None, count: Tensor) -> Tensor:
    """The learning rate of the step after ``count`` steps (float64, 0-d): the state's
    ``lr`` for a float learning rate, else ``lr_at(lr, count)`` times the state's
    factor. A state built by hand without the field (``lr=None``) uses ``lr`` as given."""
    if state_lr is None:
        return lr_at(lr, count)
    state_lr = state_lr.to(device=count.device, dtype=torch.float64)
    if isinstance(lr, Tensor) or callable(lr):
        return lr_at(lr, count) * state_lr
    return state_lr


def lr_at(lr: LearningRate, count: Tensor) -> Tensor:
    """The learning rate of the step after ``count`` steps, as a float64 0-d tensor
    beside ``count``. Schedules see ``count`` as float64, so arithmetic like
    ``1 / (1 + count)`` stays in double precision, like torch's lr."""
    value = lr(count.to(torch.float64)) if callable(lr) and not isinstance(lr, Tensor) else lr
    return as64(value, count)


def check_weight_decay(weight_decay: Hyper) -> None:
    """torch.optim's check of ``weight_decay`` (a float or 0-d tensor, >= 0)."""
    check_number(
        weight_decay, "weight_decay value", lambda v: v >= 0.0, "Invalid weight_decay value: {}"
    )


def nonzero(x: Hyper) -> bool:
    """A tensor hyperparameter counts as nonzero (no Python branch on its value)."""
    return isinstance(x, Tensor) or x != 0.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update is computed in (torch's opmath): float32 for float16 and
    bfloat16, else the dtype itself."""
    return torch.float32 if dtype in HALF else dtype


def hyper(x: Hyper) -> Hyper:
    """A hyperparameter as stored: a tensor as given, a number as a Python float."""
    return x if isinstance(x, Tensor) else float(x)


def slot_fields(state_type: type) -> tuple[str, ...]:
    """An optimizer state's per-tensor fields: those after ``count``, less ``lr``."""
    return tuple(f for f in state_type._fields[1:] if f != "lr")  # type: ignore[attr-defined]


def is_optimizer_state(x: object) -> bool:
    """A funcgrad optimizer's state: a NamedTuple whose fields start with ``count``
    and include ``lr`` (``AdamState``, ``SGDState``, ...)."""
    fields: tuple[str, ...] = getattr(type(x), "_fields", ())
    return isinstance(x, tuple) and bool(fields) and fields[0] == "count" and "lr" in fields


def optimizer_states(state: object) -> list[object]:
    """Every optimizer state inside ``state`` (through NamedTuples, tuples, lists and
    dicts), in the order :func:`with_optimizer_states` takes replacements."""
    out: list[object] = []

    def keep(s: object) -> object:
        out.append(s)
        return s

    _walk_states(state, keep)
    return out


def with_optimizer_states(state: object, new: list[object]) -> object:
    """``state`` with its optimizer states replaced, in :func:`optimizer_states`' order."""
    it = iter(new)
    out = _walk_states(state, lambda s: next(it))
    return out


def _walk_states(x: Any, fn: Callable[[object], object]) -> Any:
    if is_optimizer_state(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return type(x)(*(_walk_states(c, fn) for c in x))
    if type(x) in (tuple, list):
        return type(x)(_walk_states(c, fn) for c in x)
    if type(x) is dict:
        return {k: _walk_states(v, fn) for k, v in x.items()}
    return x


def get_lr(state: object) -> list[float]:
    """The ``lr`` field of every optimizer state inside ``state``, in order.

    For an optimizer built with a float learning rate, the field is the learning rate
    the next step uses; for a schedule or a 0-d tensor learning rate, the factor that
    multiplies it (1.0 unless changed). The learning rate is state, not part of ``tx``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.chain(fg.clip_by_global_norm(1.0), fg.adam(lr=0.01))
        >>> fg.get_lr(tx.init({"w": torch.zeros(2)}))
        [0.01]
    """
    return [float(s.lr) for s in optimizer_states(state) if s.lr is not None]  # type: ignore[attr-defined]


def set_lr(state: object, lr: float | Tensor | list[float | Tensor]) -> object:
    """``state`` with the ``lr`` field of its optimizer states replaced (a new state;
    the given one is not changed): one value for all, or a list, one per optimizer
    state in :func:`get_lr`'s order. See :func:`get_lr` for what the field means.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adam(lr=0.01)
        >>> params = {"w": torch.zeros(2)}
        >>> state = fg.set_lr(tx.init(params), 0.001)
        >>> fg.get_lr(state)
        [0.001]
        >>> fg.apply_updates(params, tx.update({"w": torch.ones(2)}, state, params)[0])["w"]
        tensor([-0.0010, -0.0010])
    """
    old = optimizer_states(state)
    values = list(lr) if isinstance(lr, (list, tuple)) else [lr] * len(old)
    if len(values) != len(old):
        raise ValueError(
            f"fg.set_lr: the state holds {len(old)} optimizer states, got {len(values)} "
            "learning rates; pass one value for all, or one per optimizer (fg.get_lr's order)."
        )
    new = []
    for s, v in zip(old, values, strict=True):
        check_lr(v if isinstance(v, Tensor) else float(v))
        like = s.count  # type: ignore[attr-defined]
        t = as64(v, like).detach().reshape(()) if isinstance(v, Tensor) else as64(float(v), like)
        new.append(s._replace(lr=t))  # type: ignore[attr-defined]
    return with_optimizer_states(state, new)
