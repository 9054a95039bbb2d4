"""Hyperparameters shared by funcgrad's optimizers: learning rates (floats, 0-d
tensors, schedules), checks with torch-style messages, weight-decay masks, and the
compute dtype (torch's "opmath": float16/bfloat16 are computed in float32)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Union

import torch
from torch import Tensor

from ._base import Params
from ._compose import plain_value
from ._tree import names_mismatch

LearningRate = Union[float, Tensor, Callable[[Tensor], Union[float, Tensor]]]
"""A float, a 0-d tensor (edit it in place to change lr without recompiling; use
float64 to match torch.optim exactly, since float32 cannot hold 0.02), or a schedule
``count -> lr`` where ``count`` is the number of steps already taken, as a float64
0-d tensor (0 on the first step, like ``LambdaLR``'s epoch)."""


Hyper = Union[float, Tensor]
"""A hyperparameter: a float, or a 0-d tensor (learnable: gradients flow into it
when the update is differentiated, see funcgrad/_compose.py)."""


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


class LrCell:
    """An optimizer's learning rate, read at every update (not captured once), so that
    :class:`funcgrad.Optimizer` can hand it the learning rate of its param group: a
    ``torch.optim.lr_scheduler`` then drives it (funcgrad/_optimizer.py)."""

    __slots__ = ("__weakref__", "value")

    def __init__(self, value: LearningRate) -> None:
        self.value = value


def lr_at(lr: LearningRate, count: Tensor) -> Tensor:
    """The learning rate of the step after ``count`` steps, as a float64 0-d tensor
    beside ``count``. Schedules see ``count`` as float64, so arithmetic like
    ``1 / (1 + count)`` stays in double precision, like torch's lr."""
    value = lr(count.to(torch.float64)) if callable(lr) and not isinstance(lr, Tensor) else lr
    return as64(value, count)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update is computed in (torch's opmath): float32 for float16 and
    bfloat16, else the dtype itself."""
    return torch.float32 if dtype in HALF else dtype


def hyper(x: Hyper) -> Hyper:
    """A hyperparameter as stored: a tensor as given, a number as a Python float."""
    return x if isinstance(x, Tensor) else float(x)
