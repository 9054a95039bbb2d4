"""Optimizer state between ``torch.optim`` and funcgrad, both ways, for every
optimizer funcgrad has a ``torch.optim`` twin of: :func:`state_from_torch` and
:func:`state_to_torch`.

The funcgrad side is found inside the whole state of ``tx`` (a chain, a named
chain, ``accumulate``...): exactly one optimizer state (``AdamState``,
``SGDState``...) must be there. Entries are matched to names by the parameter
objects (``dict(model.named_parameters())``) or by storage (``fg.params(model)``,
whose views share the module's memory), and every torch state key maps to one
field of the funcgrad state, named as in torch where the names agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core import _flat as flat
from ..core._base import GradientTransformation, State, is_int
from ..distributed._whole import contains_sharded
from ..optim._adadelta import AdadeltaState
from ..optim._adafactor import AdafactorState
from ..optim._adagrad import AdagradState
from ..optim._adam import AdamState
from ..optim._adamax import AdamaxState
from ..optim._asgd import ASGDState
from ..optim._get_set import optimizer_states, with_optimizer_states
from ..optim._hparams import scalar_fields, slot_fields, torch_scalar_dtype
from ..optim._lbfgs import LBFGSState
from ..optim._muon import MuonState
from ..optim._nadam import NAdamState
from ..optim._radam import RAdamState
from ..optim._rmsprop import RMSpropState
from ..optim._rprop import RpropState
from ..optim._sgd import SGDState
from ._torch_lbfgs import lbfgs_from_torch, lbfgs_to_torch


class _Twin(NamedTuple):
    """A funcgrad state's ``torch.optim`` form."""

    classes: tuple[type, ...]
    keys: dict[str, str]  # funcgrad field -> torch state key
    step: bool  # torch keeps a "step" per parameter
    fields: Callable[[Mapping[str, Any]], set[str]] | None  # fields in use, from a param group


def _plain_twin(state: type, cls: type) -> _Twin:
    """A twin whose state keys are the fields' names, all always in use, with a "step"
    (a 0-d field, e.g. NAdam's ``mu_product``, is one value torch keeps per parameter)."""
    fields = slot_fields(state)
    keys = {f: f for f in (*fields, *scalar_fields(state))}
    return _Twin((cls,), keys, True, lambda g: set(fields))


_TWINS: dict[type, _Twin] = {
    AdamState: _Twin(
        (torch.optim.Adam, torch.optim.AdamW),
        {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"},
        True,
        lambda g: {"mu", "nu"} | ({"nu_max"} if g["amsgrad"] else set()),
    ),
    SGDState: _Twin(
        (torch.optim.SGD,),
        {"momentum_buffer": "momentum_buffer"},
        False,
        lambda g: {"momentum_buffer"} if g["momentum"] != 0 else set(),
    ),
    RMSpropState: _Twin(
        (torch.optim.RMSprop,),
        {"square_avg": "square_avg", "momentum_buffer": "momentum_buffer", "grad_avg": "grad_avg"},
        True,
        lambda g: (
            {"square_avg"}
            | ({"momentum_buffer"} if g["momentum"] > 0 else set())
            | ({"grad_avg"} if g["centered"] else set())
        ),
    ),
    AdagradState: _plain_twin(AdagradState, torch.optim.Adagrad),
    AdadeltaState: _plain_twin(AdadeltaState, torch.optim.Adadelta),
    RpropState: _plain_twin(RpropState, torch.optim.Rprop),
    RAdamState: _plain_twin(RAdamState, torch.optim.RAdam),
    AdamaxState: _plain_twin(AdamaxState, torch.optim.Adamax),
    NAdamState: _plain_twin(NAdamState, torch.optim.NAdam),
    ASGDState: _plain_twin(ASGDState, torch.optim.ASGD),
    AdafactorState: _Twin(
        (torch.optim.Adafactor,),
        {"row_var": "row_var", "col_var": "col_var", "variance": "variance"},
        True,
        None,  # which fields are in use depends on the shapes, not on options
    ),
    LBFGSState: _Twin((torch.optim.LBFGS,), {}, False, None),  # _torch_lbfgs.py
    MuonState: _Twin(
        (torch.optim.Muon,),
        {"momentum_buffer": "momentum_buffer"},
        False,
        lambda g: {"momentum_buffer"},
    ),
}


def _find(state: State, who: str) -> tuple[int, Any]:
    """The one optimizer state with a torch.optim twin inside ``state``: its index among
    the state's optimizer states (:func:`optimizer_states`' order) and the state."""
    if contains_sharded(state):
        raise TypeError(
            f"{who}: the state is sharded across ranks (fg.sharded); convert the state "
            "of the unsharded transformation (tx without fg.sharded) and shard that."
        )
    found = [(i, x) for i, x in enumerate(optimizer_states(state)) if type(x) in _TWINS]
    if len(found) != 1:
        kinds = sorted(type(x).__name__ for _, x in found) or "none"
        raise TypeError(
            f"{who}: expected exactly one optimizer state with a torch.optim twin "
            f"({', '.join(sorted(t.__name__ for t in _TWINS))}) in the state of tx, found "
            f"{kinds}. fg.lion has no torch.optim twin; with fg.partition over two "
            "optimizers, convert each partition's transformation on its own parameters."
        )
    return found[0]


def _replace(state: State, index: int, new: Any) -> Any:
    """``state`` with its ``index``-th optimizer state replaced by ``new``."""
    states = optimizer_states(state)
    states[index] = new
    return with_optimizer_states(state, states)


def _pairs(
    optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], who: str
) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` for each of the optimizer's parameters, in its order."""
    by_id = {id(p): n for n, p in params.items()}
    by_storage = {(p.data_ptr(), tuple(p.shape), p.dtype): n for n, p in params.items()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p), by_storage.get((p.data_ptr(), tuple(p.shape), p.dtype)))
            if name is None:
                raise KeyError(
                    f"{who}: a parameter of shape {tuple(p.shape)} in the optimizer is not "
                    "among params. Pass fg.params(model) or dict(model.named_parameters()) "
                    "of the model the optimizer was built on."
                )
            out.append((name, p))
    return out


def _check_twin(node: Any, optimizer: torch.optim.Optimizer, who: str) -> _Twin:
    twin = _TWINS[type(node)]
    if not isinstance(optimizer, twin.classes):
        names = " or ".join(f"torch.optim.{c.__name__}" for c in twin.classes)
        raise TypeError(
            f"{who}: tx keeps an {type(node).__name__}, whose torch.optim twin is {names}; "
            f"got {type(optimizer).__name__}. Build tx with the same optimizer."
        )
    on = {f for f in slot_fields(type(node)) if getattr(node, f)}
    if twin.fields is not None:
        for group in optimizer.param_groups:
            want = twin.fields(group)
            if want != on:
                raise ValueError(
                    f"{who}: the torch optimizer's options keep state {sorted(want)} but tx "
                    f"keeps {sorted(on)}; build both with the same options (momentum, "
                    "centered, amsgrad)."
                )
    return twin


def state_from_torch(
    tx: GradientTransformation,
    torch_optimizer: torch.optim.Optimizer,
    params: Mapping[str, Tensor],
    *,
    count: int | None = None,
) -> State:
    """The state of ``tx`` with its optimizer's state taken from a ``torch.optim`` one.

    ``tx`` is the funcgrad optimizer built with ``torch_optimizer``'s hyperparameters
    (``fg.sgd`` for ``SGD``, ``fg.rmsprop``, ``fg.adagrad``, ``fg.adafactor``,
    ``fg.muon``, ``fg.adam``/``fg.adamw``), alone or inside a chain: the rest of the
    state is ``tx.init(params)``'s. The step counter is torch's ``"step"``; SGD and
    Muon keep none, so ``count`` is 1 once they hold momentum buffers (0 before)
    unless given (pass the steps taken when a schedule reads it). A parameter the
    optimizer has no state for yet starts as ``tx.init`` starts it.

    Args:
        tx: the funcgrad transformation to continue with.
        torch_optimizer: the torch optimizer, possibly before its first step.
        params: ``fg.params(model)`` or ``dict(model.named_parameters())``.
        count: the step count, for optimizers whose torch state has none.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> tx = fg.sgd(lr=0.1, momentum=0.9)
        >>> state = fg.state_from_torch(tx, opt, fg.params(model))
        >>> int(state.count), state.momentum_buffer["bias"]
        (1, tensor([1.]))
    """
    who = "fg.state_from_torch"
    template = tx.init(params)  # type: ignore[arg-type]
    path, node = _find(template, who)
    twin = _check_twin(node, torch_optimizer, who)
    pairs = _pairs(torch_optimizer, params, who)
    if isinstance(node, LBFGSState):
        names = [n for n, _ in pairs]
        return _replace(template, path, lbfgs_from_torch(node, torch_optimizer, names, params, who))
    by_name = dict(pairs)
    fields = [f for f in slot_fields(type(node)) if getattr(node, f)]
    mine = set().union(*(getattr(node, f).keys() for f in fields)) if fields else set()
    if mine - by_name.keys():
        raise KeyError(
            f"{who}: tx keeps state for {sorted(mine - by_name.keys())}, which the torch "
            "optimizer does not hold; build both on the same parameters."
        )
    held = [torch_optimizer.state[p] for _, p in pairs if torch_optimizer.state.get(p)]
    new: dict[str, Any] = {}
    for f in fields:
        start = getattr(node, f)
        out = {}
        for name in start:
            value = torch_optimizer.state.get(by_name[name], {}).get(twin.keys[f])
            out[name] = start[name] if value is None else _fit(value, start[name], name, f, who)
        new[f] = flat.like(out, start.layout if isinstance(start, flat.Flat) else None)
    # A parameter with no torch state never took a step (torch skips a parameter
    # without a gradient): step 0 beside the others' steps.
    n = _count(twin, held, count, who, never_stepped=len(pairs) - len(held))
    device = node.count.device
    fresh = node._replace(count=torch.tensor(n, dtype=torch.int64, device=device), **new)
    for f in scalar_fields(type(node)):
        fresh = fresh._replace(**{f: _one_value(held, twin.keys[f], getattr(node, f), who)})
    return _replace(template, path, fresh)


def _one_value(held: list[dict[str, Any]], key: str, start: Tensor, who: str) -> Tensor:
    """A value torch keeps per parameter (NAdam's ``mu_product``) that funcgrad keeps
    once: equal on every parameter, or the error."""
    values = {float(st[key]) for st in held if key in st}
    if len(values) > 1:
        raise ValueError(
            f"{who}: the optimizer's parameters hold different '{key}' values "
            f"{sorted(values)}; funcgrad keeps one per transformation. Convert after a step "
            "that updated every parameter."
        )
    if not values:
        return start
    return torch.tensor(values.pop(), dtype=start.dtype, device=start.device)


def _fit(value: Tensor, start: Tensor, name: str, field: str, who: str) -> Tensor:
    if tuple(value.shape) != tuple(start.shape):
        raise ValueError(
            f"{who}: torch's state for '{name}' ({field}) has shape {tuple(value.shape)}, "
            f"tx expects {tuple(start.shape)}."
        )
    return value.detach().to(dtype=start.dtype, device=start.device, copy=True)


def _count(
    twin: _Twin, held: list[dict[str, Any]], count: int | None, who: str, never_stepped: int = 0
) -> int:
    if twin.step:
        steps = {int(st["step"]) for st in held if "step" in st}
        if never_stepped and steps:
            steps.add(0)
        if len(steps) > 1:
            raise ValueError(
                f"{who}: the optimizer's parameters are at different steps {sorted(steps)}; "
                "funcgrad keeps one step counter per transformation. Convert after a step "
                "that updated every parameter."
            )
        found = steps.pop() if steps else 0
        if count is not None and count != found:
            raise ValueError(f"{who}: count={count}, but the torch state is at step {found}.")
        return found
    buffered = any(st.get("momentum_buffer") is not None for st in held)
    if count is None:
        return 1 if buffered else 0
    if not is_int(count) or count < int(buffered):
        raise ValueError(
            f"{who}: count={count!r}; expected an int >= {int(buffered)} (the optimizer "
            f"{'holds' if buffered else 'holds no'} momentum buffers)."
        )
    return count


def state_to_torch(
    tx: GradientTransformation,
    state: State,
    torch_optimizer: torch.optim.Optimizer,
    params: Mapping[str, Tensor],
) -> None:
    """Write the optimizer state inside ``state`` (of ``tx``) into ``torch_optimizer``.

    The reverse of :func:`state_from_torch`: the torch optimizer, built with the
    same hyperparameters, then continues as funcgrad would have.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> tx = fg.rmsprop(lr=0.01, momentum=0.9)
        >>> params = fg.params(model)
        >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9)
        >>> fg.state_to_torch(tx, tx.init(params), opt, params)
        >>> sorted(opt.state[model.weight])
        ['momentum_buffer', 'square_avg', 'step']
    """
    who = "fg.state_to_torch"
    _, node = _find(state, who)
    _, like = _find(tx.init(params), who)  # type: ignore[arg-type]
    if type(like) is not type(node):
        raise TypeError(
            f"{who}: the state holds an {type(node).__name__} but tx keeps an "
            f"{type(like).__name__}; pass the state tx made."
        )
    twin = _check_twin(node, torch_optimizer, who)
    if isinstance(node, LBFGSState):
        names = [n for n, _ in _pairs(torch_optimizer, params, who)]
        lbfgs_to_torch(node, torch_optimizer, names, params, who)
        return
    fields = [f for f in slot_fields(type(node)) if getattr(node, f)]
    # torch's step dtype (torch.optim.optimizer._get_scalar_dtype): float64 only when
    # that is the default dtype.
    step_dtype = torch_scalar_dtype()
    for name, p in _pairs(torch_optimizer, params, who):
        entry: dict[str, Any] = {}
        if twin.step:
            entry["step"] = torch.tensor(float(node.count), dtype=step_dtype)
        for f in scalar_fields(type(node)):  # torch keeps one per parameter
            entry[twin.keys[f]] = getattr(node, f).detach().to(step_dtype).clone()
        for f in fields:
            tensors = getattr(node, f)
            if name in tensors:
                entry[twin.keys[f]] = tensors[name].detach().to(p.dtype).clone()
        if fields and not any(twin.keys[f] in entry for f in fields):
            raise KeyError(
                f"{who}: the state has no entries for the optimizer's parameter '{name}'."
            )
        torch_optimizer.state[p] = entry
