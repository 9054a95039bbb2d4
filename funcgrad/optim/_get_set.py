"""Reading and writing an optimizer state's hyperparameters by name: the public
:func:`get_hyperparams`, :func:`set_hyperparams`, :func:`get_lr`, :func:`set_lr`, and the
walk that finds every optimizer state inside a transformation's state
(:func:`optimizer_states`, :func:`walk_states`). What a hyperparameter is and how it is
checked: funcgrad/optim/_hparams.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..core._combine import ParamGroupsState
from ._hparams import checks_of, hyper, is_optimizer_state, is_schedule


def optimizer_states(state: object) -> list[Any]:
    """Every optimizer state inside ``state`` (through NamedTuples, tuples, lists and
    dicts), in the order :func:`with_optimizer_states` takes replacements."""
    out: list[object] = []

    def keep(s: object) -> object:
        out.append(s)
        return s

    walk_states(state, keep)
    return out


def with_optimizer_states(state: object, new: list[Any]) -> Any:
    """``state`` with its optimizer states replaced, in :func:`optimizer_states`' order."""
    it = iter(new)
    return walk_states(state, lambda s: next(it))


def walk_states(x: Any, fn: Callable[..., Any], *, indexed: bool = False) -> Any:
    """``x`` with ``fn`` applied to each optimizer state inside it. ``fn`` takes the
    state, or with ``indexed`` the state and its param group's index (``fg.grouped``)."""
    return _walk(x, fn, indexed, 0)


def _walk(x: Any, fn: Callable[..., Any], two: bool, group: int) -> Any:
    if is_optimizer_state(x):
        return fn(x, group) if two else fn(x)
    if isinstance(x, ParamGroupsState):
        return ParamGroupsState(tuple(_walk(c, fn, two, i) for i, c in enumerate(x[0])))
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return type(x)(*(_walk(c, fn, two, group) for c in x))
    if type(x) in (tuple, list):
        return type(x)(_walk(c, fn, two, group) for c in x)
    if type(x) is dict:
        return {k: _walk(v, fn, two, group) for k, v in x.items()}
    return x


def _plain(entry: Any, inside: bool = False) -> Any:
    if isinstance(entry, tuple):
        return tuple(_plain(v, True) for v in entry)
    if entry is None:
        return None if inside else 0.0
    return float(entry)


def get_hyperparams(state: object) -> list[dict[str, Any]]:
    """The hyperparameters of every optimizer state inside ``state``, in order: one dict
    per optimizer, ``name -> value`` (a float; a tuple for ``betas``), each the value the
    next step uses. A term built off (``weight_decay=0.0``) is not in state, so not in
    its dict: build the optimizer with the term on to change it while training.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.chain(fg.clip_by_global_norm(1.0), fg.adam(lr=0.01))
        >>> fg.get_hyperparams(tx.init({"w": torch.zeros(2)}))
        [{'lr': 0.01, 'betas': (0.9, 0.999), 'eps': 1e-08}]
    """
    return [
        {k: _plain(v) for k, v in s.hyperparams.items()}
        for s in optimizer_states(state)
        if s.hyperparams is not None
    ]


def set_hyperparams(state: object, which: int | None = None, /, **values: Any) -> Any:
    """``state`` with hyperparameters replaced by name, in every optimizer state inside
    it (or only the ``which``-th, in :func:`get_hyperparams`' order): a new state, the
    given one is not changed. Each value is a float or a 0-d (or 1-element) tensor
    (kept as it is: edit it in place later), checked as the factory checks it; it is
    the value the next step uses (a schedule then goes on from the step after). A
    compiled step does not recompile.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adam(lr=0.01)
        >>> params = {"w": torch.zeros(2)}
        >>> state = fg.set_hyperparams(tx.init(params), lr=0.001, betas=(0.8, 0.99))
        >>> fg.get_hyperparams(state)[0]["betas"]
        (0.8, 0.99)
        >>> fg.apply_updates(params, tx.update({"w": torch.ones(2)}, state, params)[0])["w"]
        tensor([-0.0010, -0.0010])
    """
    old = optimizer_states(state)
    if which is not None and not (isinstance(which, int) and 0 <= which < len(old)):
        raise IndexError(
            f"fg.set_hyperparams: which={which!r}, but the state holds {len(old)} optimizer "
            "states; pass an index in fg.get_hyperparams' order, or None for all."
        )
    targets = range(len(old)) if which is None else [which]
    new = list(old)
    for i in targets:
        new[i] = _set(old[i], values, strict=which is not None or len(old) == 1)
    if which is None and len(old) > 1:
        known = set().union(*(s.hyperparams or {} for s in old))
        unknown = sorted(set(values) - known)
        if unknown:
            raise KeyError(_unknown(unknown, sorted(known)))
    return with_optimizer_states(state, new)


def _unknown(names: list[str], known: list[str]) -> str:
    return (
        f"fg.set_hyperparams: no optimizer in the state has {names}; its hyperparameters "
        f"are {known}."
    )


def _set(s: Any, values: Mapping[str, Any], strict: bool) -> Any:
    hp = dict(s.hyperparams or {})
    checks = checks_of(type(s))
    like = s.count
    for name, value in values.items():
        if name not in hp:
            if strict:
                raise KeyError(
                    _unknown([name], sorted(hp))
                    + f" A term built off ({name}=0.0, or Adafactor's eps=(None, ...)) is not "
                    "in the state: build the optimizer with it set (a 0-d tensor holding 0.0 "
                    "starts it at zero and lets you change it later)."
                )
            continue
        value = hyper(value)
        if is_schedule(value) or (isinstance(value, tuple) and any(map(is_schedule, value))):
            raise TypeError(
                f"fg.set_hyperparams: {name} is a schedule; a state holds values. Build the "
                "optimizer with the schedule instead (fg.adam(lr=fg.cosine_decay(...)))."
            )
        checks.get(name, lambda v: None)(value)
        hp[name] = _entry(hp[name], value, name, type(s).__name__, like)
    return s._replace(hyperparams=hp)


def _entry(old: Any, value: Any, name: str, kind: str, like: Tensor) -> Any:
    if isinstance(old, tuple):
        if not (isinstance(value, tuple) and len(value) == len(old)):
            raise ValueError(f"fg.set_hyperparams: {name} is a pair; got {value!r}.")
        return tuple(_entry(o, v, name, kind, like) for o, v in zip(old, value, strict=True))
    if value is None:
        raise ValueError(f"fg.set_hyperparams: {name} cannot be None here.")
    if isinstance(value, Tensor):
        return value.detach() if not value.requires_grad else value
    return torch.tensor(float(value), dtype=torch.float64, device=like.device)


def get_lr(state: object) -> list[float]:
    """The learning rate of every optimizer state inside ``state``, in order: the value
    the next step uses (``[h["lr"] for h in fg.get_hyperparams(state)]``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.chain(fg.clip_by_global_norm(1.0), fg.adam(lr=0.01))
        >>> fg.get_lr(tx.init({"w": torch.zeros(2)}))
        [0.01]
    """
    return [h["lr"] for h in get_hyperparams(state) if "lr" in h]


def set_lr(state: object, lr: float | Tensor | list[float | Tensor]) -> Any:
    """``state`` with its learning rates replaced: one value for all optimizer states,
    or a list, one per optimizer state in :func:`get_lr`'s order (``fg.set_hyperparams``
    with ``lr=``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adam(lr=0.01)
        >>> params = {"w": torch.zeros(2)}
        >>> state = fg.set_lr(tx.init(params), 0.001)
        >>> fg.get_lr(state)
        [0.001]
    """
    n = len(optimizer_states(state))
    if not isinstance(lr, (list, tuple)):
        return set_hyperparams(state, lr=lr)
    if len(lr) != n:
        raise ValueError(
            f"fg.set_lr: the state holds {n} optimizer states, got {len(lr)} "
            "learning rates; pass one value for all, or one per optimizer (fg.get_lr's order)."
        )
    for i, v in enumerate(lr):
        state = set_hyperparams(state, i, lr=v)
    return state
