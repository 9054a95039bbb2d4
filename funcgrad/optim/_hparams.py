"""Hyperparameters shared by funcgrad's optimizers: checks with torch-style messages,
weight-decay masks, the compute dtype (torch's "opmath": float16/bfloat16 are
computed in float32), and hyperparameters as state.

Every numeric hyperparameter of an optimizer (lr, betas, eps, weight_decay,
momentum, ...) lives in its state's ``hyperparams`` dict, under torch's name, as the
value the *next* step uses (optax's ``inject_hyperparams``): a float is stored as a
float64 0-d tensor, a 0-d tensor as the tensor itself (edit it in place, or let
gradients flow into it), a schedule ``count -> value`` as its value for the next step
(recomputed after each step). :func:`get_hyperparams` / :func:`set_hyperparams` read
and write them by name; a compiled step takes them as inputs and never recompiles when
one changes. A hyperparameter built as exactly ``0.0`` where zero switches a term off
(``weight_decay``; ``momentum``, whose buffers then do not exist) is not in the state:
the update has no such term, and setting it is an error that says how to build the
optimizer instead (``fg.Optimizer`` rebuilds it itself when a param group turns it
on). Adafactor's ``eps`` is in the state only when ``eps[0]`` is a number (``None``
means the parameter dtype's epsilon).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Union

import torch
from torch import Tensor

from ..core._base import GradientTransformation, Params, is_number, with_facts
from ..core._compose import plain_value
from ..core._tree import names_mismatch

LearningRate = Union[float, Tensor, Callable[[Tensor], Union[float, Tensor]]]
"""A float, a 0-d tensor, or a schedule ``count -> lr`` where ``count`` is the number
of steps already taken, as a float64 0-d tensor (0 on the first step, like
``LambdaLR``'s epoch). Any numeric hyperparameter may be given the same three ways."""


Hyper = Union[float, Tensor, Callable[[Tensor], Union[float, Tensor]]]
"""A hyperparameter: a float, a 0-d (or 1-element) tensor (learnable: gradients flow
into it when the update is differentiated, see funcgrad/core/_compose.py), or a
schedule ``count -> value``."""


def as64(x: Any, like: Tensor) -> Tensor:
    """A hyperparameter as a float64 0-d tensor beside ``like`` (a float becomes a
    constant; a tensor keeps its autograd history)."""
    if isinstance(x, Tensor):
        return x.to(device=like.device, dtype=torch.float64)
    return torch.tensor(x, dtype=torch.float64, device=like.device)


def is_schedule(x: object) -> bool:
    return callable(x) and not isinstance(x, Tensor)


def scalar(x: Any) -> Any:
    """A 1-element tensor as a 0-d view (torch.optim accepts ``lr=torch.tensor([0.01])``);
    anything else unchanged."""
    if isinstance(x, Tensor) and x.dim() != 0 and x.numel() == 1:
        return x.reshape(())
    return x


def check_number(
    x: Any, what: str, ok: Callable[[float], bool], message: str, short: str = ""
) -> None:
    """Validate a float, a 0-d (or 1-element) tensor or a schedule; a tensor's value is
    checked where it can be read (not while compiled or under ``vmap``), a schedule's
    when it is evaluated."""
    if is_schedule(x):
        return
    if isinstance(x, Tensor):
        short = short or what
        if x.numel() != 1:
            raise ValueError(
                f"Invalid {what}: Tensor {short} must be 1-element (one value), got shape "
                f"{tuple(x.shape)}."
            )
        if not torch.is_floating_point(x):
            raise TypeError(
                f"Invalid {what}: a tensor {short} must be floating point (float64 "
                f"matches torch.optim exactly), got {x.dtype}."
            )
        value = plain_value(x.reshape(()))
        if value is not None and not ok(value):
            raise ValueError(message.format(value))
        return
    if not is_number(x):
        raise TypeError(f"Invalid {what}: {x!r}. Use a float, a 0-d tensor or a schedule.")
    if not ok(x):
        raise ValueError(message.format(x))


def check_bool(x: object, name: str, who: str) -> None:
    """A bool option given anything but a bool is an error (``nesterov=5e-4`` is a
    misplaced positional argument, not a truth value)."""
    if not isinstance(x, bool):
        raise TypeError(
            f"{who}: {name} must be a bool, got {x!r} ({type(x).__name__}). Was a number "
            "passed in its place? funcgrad takes torch.optim's positional order; pass "
            f"options by keyword ({name}=True)."
        )


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


def check_lr(lr: Any) -> None:
    """Validate a learning rate: a float >= 0, a 0-d floating tensor, or a schedule."""
    if isinstance(lr, Tensor) or is_schedule(lr):
        check_number(lr, "learning rate", lambda v: v >= 0.0, "Invalid learning rate: {}", "lr")
    elif not is_number(lr):
        raise TypeError(
            f"Invalid learning rate: {lr!r}. Use a float, a 0-d tensor, or a schedule "
            "count -> lr (e.g. fg.cosine_decay(1e-3, 1000))."
        )
    elif not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_weight_decay(weight_decay: Any) -> None:
    """torch.optim's check of ``weight_decay`` (a float or 0-d tensor, >= 0)."""
    check_number(
        weight_decay, "weight_decay value", lambda v: v >= 0.0, "Invalid weight_decay value: {}"
    )


def check_eps(eps: Any) -> None:
    check_number(eps, "epsilon value", lambda v: v >= 0.0, "Invalid epsilon value: {}")


def check_momentum(momentum: Any) -> None:
    check_number(momentum, "momentum value", lambda v: v >= 0.0, "Invalid momentum value: {}")


def check_betas(betas: Any, names: tuple[str, str] = ("beta", "beta")) -> None:
    """A pair of betas in [0, 1): both floats or both tensors, as torch requires."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2).")
    kinds = {isinstance(b, Tensor) for b in betas}
    if len(kinds) > 1:
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        check_number(
            b,
            f"beta parameter at index {i}",
            lambda v: 0.0 <= v < 1.0,
            f"Invalid beta parameter at index {i}: {{}}",
            names[i],
        )


def nonzero(x: Any) -> bool:
    """A tensor or schedule hyperparameter counts as nonzero (no Python branch on
    its value)."""
    if isinstance(x, (tuple, list)):
        return any(nonzero(v) for v in x)
    return isinstance(x, Tensor) or is_schedule(x) or x != 0.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update is computed in (torch's opmath): float32 for float16 and
    bfloat16, else the dtype itself."""
    return torch.float32 if dtype in HALF else dtype


def hyper(x: Any) -> Any:
    """A hyperparameter as built: a tensor as a 0-d tensor (a view of a 1-element one),
    a schedule as given, a number as a Python float, a pair as a tuple."""
    if isinstance(x, (tuple, list)):
        return tuple(hyper(v) for v in x)
    if x is None or isinstance(x, Tensor) or is_schedule(x):
        return scalar(x)
    return float(x)


def off_if_zero(x: Any) -> Any:
    """``None`` (the term is off: not in the update) for a hyperparameter built as
    exactly zero, else :func:`hyper`'s form."""
    return hyper(x) if nonzero(x) else None


# ---- hyperparameters as state: the values of the next step


def start_value(built: Any, like: Tensor) -> Any:
    """A hyperparameter's entry in the state that ``init`` makes: a float as a float64
    0-d tensor beside ``like``, a tensor as itself, a schedule's value at count 0."""
    if isinstance(built, tuple):
        return tuple(start_value(v, like) for v in built)
    if built is None or isinstance(built, Tensor):
        return built
    if is_schedule(built):
        return as64(built(torch.zeros((), dtype=torch.float64, device=like.device)), like)
    return torch.tensor(float(built), dtype=torch.float64, device=like.device)


def next_value(built: Any, now: Any, count: Tensor) -> Any:
    """The entry after a step that ends at ``count`` steps: a schedule's value at
    ``count``, else the entry as it was."""
    if isinstance(built, tuple):
        return tuple(next_value(b, n, count) for b, n in zip(built, now, strict=True))
    if is_schedule(built):
        return as64(built(count.to(torch.float64)), count)
    return now


def value64(entry: Any, like: Tensor) -> Any:
    """A state entry as the float64 0-d tensor a step computes with (None stays None)."""
    if isinstance(entry, tuple):
        return tuple(value64(v, like) for v in entry)
    return None if entry is None else as64(entry, like)


@dataclass(frozen=True)
class OptimizerInfo:
    """What ``tx.facts.optimizer`` says of an optimizer: its name (``"fg.adam"``), its
    factory and every argument it was built with (``kwargs``, by name: a param group's
    keys override them), the hyperparameters its state holds (``hyper``, as built) and
    its state type."""

    who: str
    state: type
    hyper: Mapping[str, Any]
    factory: Callable[..., GradientTransformation] | None = None
    kwargs: Mapping[str, Any] | None = None

    def rebuild(self, **overrides: Any) -> GradientTransformation:
        """The same optimizer with some arguments changed (checked as at build)."""
        assert self.factory is not None and self.kwargs is not None
        return self.factory(**{**self.kwargs, **overrides})


def optimizer(factory: Callable[..., GradientTransformation]) -> Any:
    """Decorate an optimizer's factory: the transformation it builds records the
    factory and every argument (defaults filled in) on ``tx.facts.optimizer``, so
    ``fg.grouped`` and ``fg.Optimizer`` can rebuild it with a param group's values."""
    params = inspect.signature(factory).parameters
    defaults = {n: p.default for n, p in params.items()}
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        tx = factory(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(positional, args, strict=False))
        bound.update(kwargs)
        info = replace(tx.facts.optimizer, factory=build, kwargs=bound)
        return with_facts(tx, optimizer=info)

    return build


# ---- each state type's hyperparameters, checked when set


_CHECKS: dict[type, dict[str, Callable[[Any], None]]] = {}


def hyperparameters(state_type: type, **checks: Callable[[Any], None]) -> None:
    """Declare the hyperparameters a state type holds and how a new value is checked
    (the factory's own check, so the messages are torch's)."""
    if "hyperparams" not in getattr(state_type, "_fields", ()):
        raise ValueError(f"hyperparameters: {state_type.__name__} has no hyperparams field.")
    _CHECKS[state_type] = dict(checks)


def checks_of(state_type: type) -> Mapping[str, Callable[[Any], None]]:
    """The checks :func:`hyperparameters` registered for ``state_type`` (none: empty)."""
    return _CHECKS.get(state_type, {})


def check_hyperparameters(state_type: type, **values: Any) -> None:
    """Check the hyperparameters a factory was given, with the same checks as a set."""
    checks = _CHECKS[state_type]
    for name, value in values.items():
        checks[name](value)


def is_optimizer_state(x: object) -> bool:
    """A funcgrad optimizer's state: a NamedTuple whose fields start with ``count``
    and include ``hyperparams`` (``AdamState``, ``SGDState``, ...)."""
    fields: tuple[str, ...] = getattr(type(x), "_fields", ())
    return (
        isinstance(x, tuple) and bool(fields) and fields[0] == "count" and "hyperparams" in fields
    )


def slot_fields(state_type: type) -> tuple[str, ...]:
    """An optimizer state's per-tensor fields: those after ``count``, less ``hyperparams``
    and the :func:`scalar_fields`."""
    fields: tuple[str, ...] = state_type._fields[1:]  # type: ignore[attr-defined]
    carried = scalar_fields(state_type)
    return tuple(f for f in fields if f != "hyperparams" and f not in carried)


def torch_scalar_dtype() -> torch.dtype:
    """The dtype ``torch.optim`` keeps its per-parameter scalars in (``step``, NAdam's
    ``mu_product``, ASGD's ``eta`` and ``mu``; its ``_get_scalar_dtype``): float64 only
    when that is the default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def scalar_fields(state_type: type) -> tuple[str, ...]:
    """An optimizer state's 0-d fields after ``count``: values the optimizer carries
    from step to step for all its tensors at once (NAdam's ``mu_product``), declared
    by the annotation ``Tensor`` where a slot field is a ``dict[str, Tensor]``."""
    notes = getattr(state_type, "__annotations__", {})
    return tuple(
        f
        for f in state_type._fields[1:]  # type: ignore[attr-defined]
        if getattr(notes.get(f), "__forward_arg__", notes.get(f)) in ("Tensor", Tensor)
    )
