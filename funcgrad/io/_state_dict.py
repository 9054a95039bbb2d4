"""Checkpoints of transformation states as plain nested dicts of tensors.

``torch.load(weights_only=True)`` accepts dicts, lists, tensors and plain values
but not NamedTuples, so a state is written as nested dicts: a NamedTuple becomes
``{"_type": "AdamState", "count": ..., "mu": {...}}``, a tuple becomes
``{"_type": "tuple", "0": ..., "1": ...}``. Both directions walk the state with
optree's accessors (``funcgrad.core._tree.flatten``), so every entry has a readable path
(``state.inner_states[1].mu['fc1.weight']``). Loading takes the structure from
``tx.init(params)`` and checks the checkpoint against it path by path, so any
mismatch (another transformation, another model, another shape or dtype) is named.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import optree
from torch import Tensor

from ..core._base import GradientTransformation, Params, State, params_device
from ..core._invariants import check_invariants
from ..core._tree import flatten, names_mismatch
from ..distributed._sharded import ShardedState
from ..distributed._whole import (
    checkpoint_view,
    contains_sharded,
    copied_dtensor,
    full_tensors,
    whole_template,
)
from ..optim._param_groups import optimizers_in

_PLAIN = (bool, int, float, str)

_HINT = (
    " The checkpoint was made by another transformation or for another model; "
    "rebuild tx and params exactly as when it was saved."
)


def _type_name(container: type) -> str:
    return "dict" if issubclass(container, Mapping) else container.__name__


def _key(entry: optree.PyTreeEntry) -> str:
    """The key under which a container's child is saved."""
    if issubclass(entry.type, Mapping):
        if not isinstance(entry.entry, str) or entry.entry == "_type":
            raise TypeError(
                f"fg.state_dict: dict keys must be str (not '_type'), got {[entry.entry]!r}."
            )
        return entry.entry
    if optree.is_namedtuple_class(entry.type):
        return str(entry.type._fields[entry.entry])  # type: ignore[attr-defined]
    if entry.type in (tuple, list):
        return str(entry.entry)
    raise TypeError(
        f"fg.state_dict: cannot store a {entry.type.__name__} in a checkpoint; states hold "
        "tensors in NamedTuples, tuples and dicts."
    )


def _plain_leaf(x: Any) -> Any:
    if isinstance(x, Tensor):
        if hasattr(x, "placements"):  # a DTensor: copied without a DTensor op
            return copied_dtensor(x)
        return x.detach().clone()
    if x is None or isinstance(x, _PLAIN):
        return x
    raise TypeError(
        f"fg.state_dict: cannot store a {type(x).__name__} in a checkpoint; states hold "
        "tensors in NamedTuples, tuples and dicts."
    )


def state_dict(state: State) -> dict[str, Any]:
    """A plain nested dict of tensors for ``state``, for ``torch.save``.

    The state of ``fg.sharded(tx)`` gives the same keys as ``tx``'s own, with each
    row-split tensor as a ``DTensor`` of its whole shape: save that one with
    ``torch.distributed.checkpoint`` (collective: call it on every rank), and load it
    on any number of ranks, or unsharded (``docs/distributed.md``).

    Examples:
        >>> import io, torch, funcgrad as fg
        >>> tx = fg.adam()
        >>> params = {"w": torch.ones(2)}
        >>> _, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> buf = io.BytesIO(); torch.save(fg.state_dict(state), buf); _ = buf.seek(0)
        >>> loaded = fg.load_state_dict(tx, params, torch.load(buf, weights_only=True))
        >>> int(loaded.count), torch.equal(loaded.mu["w"], state.mu["w"])
        (1, True)
    """
    if isinstance(state, ShardedState):  # the whole shapes, as DTensors (collective)
        state = checkpoint_view(state)
    elif contains_sharded(state):
        raise TypeError(
            "fg.state_dict: the state holds a ShardedState inside another transformation's "
            "state; checkpoints describe sharded state only when fg.sharded is the "
            "outermost transformation. Wrap the whole chain: fg.sharded(fg.chain(...))."
        )
    accessors, leaves, _ = flatten(state)
    if len(accessors) == 1 and len(accessors[0]) == 0:  # the state is one leaf
        return {"_type": "value", "value": _plain_leaf(leaves[0])}
    out: dict[str, Any] = {}
    for accessor, leaf in zip(accessors, leaves, strict=True):
        node = out
        for depth, entry in enumerate(accessor):
            key = _key(entry)
            if not issubclass(entry.type, Mapping):
                node["_type"] = entry.type.__name__
            if depth == len(accessor) - 1:
                node[key] = _plain_leaf(leaf)
            else:
                node = node.setdefault(key, {})
    return out


def _saved(node: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(path, kind, value)`` for every container and leaf of a saved state dict;
    ``kind`` is the container's ``_type`` (``"dict"`` for plain dicts) or ``"leaf"``."""
    if not isinstance(node, Mapping):
        yield path, "leaf", node
        return
    kind = str(node.get("_type", "dict"))
    yield path, kind, node
    for k, v in node.items():
        if k == "_type":
            continue
        if kind == "dict":
            sub = f"{path}[{k!r}]"
        elif kind in ("tuple", "list"):
            sub = f"{path}[{k}]"
        else:
            sub = f"{path}.{k}"
        yield from _saved(v, sub)


def load_state_dict(
    tx: GradientTransformation, params: Params, state_dict: Mapping[str, Any]
) -> State:
    """Rebuild the state of ``tx`` from :func:`state_dict`'s output.

    The structure comes from ``tx.init(params)``; every tensor is checked for shape
    and dtype and copied onto the device of ``params``. Resuming from it continues
    bit for bit (see ``tests/test_reliability.py``).

    The state's invariants (declared with :func:`invariants`: finite moments,
    non-negative second moments and counters) are checked too, so a damaged
    checkpoint fails here instead of silently spoiling the run.

    Raises:
        ValueError / KeyError / TypeError: naming the paths where the checkpoint
            and ``tx`` disagree, or where an invariant is broken.

    Examples:
        >>> import torch, funcgrad as fg
        >>> params = {"w": torch.zeros(2)}
        >>> sd = fg.state_dict(fg.adam().init(params))
        >>> fg.load_state_dict(fg.adam(), params, sd).count
        tensor(0)
        >>> fg.load_state_dict(fg.adamw(amsgrad=True), params, sd)
        Traceback (most recent call last):
        ...
        KeyError: "fg.load_state_dict: the checkpoint does not match tx.init(params): ...
    """
    return load(tx, params, state_dict, report_lr=True)


def _hyper_paths(template: State) -> list[str]:
    """The path of every optimizer state's ``hyperparams`` field in ``template``
    (``state.inner_states[1].hyperparams``), in the order of ``optimizer_states``."""
    out: list[str] = []
    accessors, _, _ = flatten(template)
    for accessor in accessors:
        for depth, entry in enumerate(accessor):
            fields = getattr(entry.type, "_fields", ())
            if fields and fields[0] == "count" and fields[entry.entry] == "hyperparams":
                path = accessor[: depth + 1].codify("state")
                if path not in out:
                    out.append(path)
    return out


def _migrate_hyperparams(
    tx: GradientTransformation, template: State, saved: dict[str, tuple[str, Any]]
) -> None:
    """A checkpoint written before every hyperparameter was state: its optimizer states
    have no ``hyperparams`` (and, before the learning rate was state, no ``lr``). They
    start as ``tx.init`` makes them, but for a float learning rate the checkpoint's
    ``lr``, which was its value (for a schedule or a tensor it was a factor, 1.0 unless
    set: another factor is not kept, with a warning)."""
    paths = _hyper_paths(template)
    infos = optimizers_in(tx)
    kinds = [i.hyper.get("lr") for i in infos] if len(infos) == len(paths) else [0.0] * len(paths)
    mine = {p: (k, v) for p, k, v in _saved(state_dict(template), "state")}
    for path, lr in zip(paths, kinds, strict=True):
        owner = path[: -len(".hyperparams")]
        if path in saved or owner not in saved:
            continue
        for p, entry in mine.items():
            if p == path or p.startswith(path + "["):
                saved[p] = entry
        old = saved.pop(f"{owner}.lr", None)
        if old is None:
            continue
        value = old[1]
        if isinstance(lr, float):
            saved[f"{path}['lr']"] = ("leaf", value)
        elif isinstance(value, Tensor) and float(value) != 1.0:
            warnings.warn(
                f"fg.load_state_dict: {owner}.lr in this older checkpoint is a factor "
                f"{float(value):.6g} of tx's schedule or tensor learning rate; a state now "
                "holds the learning rate itself, and the factor is not kept. Set the "
                "value with fg.set_hyperparams(state, lr=...).",
                stacklevel=4,
            )


def load(
    tx: GradientTransformation, params: Params, state_dict: Mapping[str, Any], report_lr: bool
) -> State:
    """:func:`load_state_dict`; ``report_lr=False`` for ``fg.Optimizer``, whose param
    group's lr (restored with it) overwrites the optimizers' ``lr`` at every step."""
    template = tx.init(params)
    cut = None
    if isinstance(template, ShardedState):  # check and load whole, then keep our rows
        template, cut = whole_template(template)
    state_dict = full_tensors(state_dict)  # DTensors from torch.distributed.checkpoint
    device = params_device(params)
    accessors, leaves, spec = flatten(template)
    if isinstance(state_dict, Mapping) and state_dict.get("_type") == "value":
        saved_root: Any = state_dict["value"]
    else:
        saved_root = state_dict
    saved = {p: (kind, v) for p, kind, v in _saved(saved_root, "state")}
    _migrate_hyperparams(tx, template, saved)
    hyper = tuple(f"{p}[" for p in _hyper_paths(template))
    # Containers first: a NamedTuple of another type is the clearest message.
    for accessor in accessors:
        for depth, entry in enumerate(accessor):
            where = accessor[:depth].codify("state")
            found = saved.get(where, ("missing", None))[0]
            if where in saved and found != _type_name(entry.type):
                raise TypeError(
                    f"fg.load_state_dict: {where} should be a {_type_name(entry.type)}, "
                    f"found {found}.{_HINT}"
                )
    paths = [a.codify("state") for a in accessors]
    saved_leaves = [p for p, (kind, _) in saved.items() if kind == "leaf"]
    saved_leaves += [p for p, (kind, v) in saved.items() if kind != "leaf" and p in paths]
    if sorted(paths) != sorted(saved_leaves):
        mismatch = names_mismatch(paths, saved_leaves, lambda ps: ", ".join(ps) or "(none)")
        raise KeyError(
            f"fg.load_state_dict: the checkpoint does not match tx.init(params): {mismatch}.{_HINT}"
        )
    loaded = []
    for path, want in zip(paths, leaves, strict=True):
        kind, value = saved[path]
        if isinstance(want, Tensor):
            if not isinstance(value, Tensor):
                found = kind if kind != "leaf" else type(value).__name__
                raise TypeError(
                    f"fg.load_state_dict: {path} should be a tensor, found {found}.{_HINT}"
                )
            if value.shape != want.shape or value.dtype != want.dtype:
                raise ValueError(
                    f"fg.load_state_dict: {path} has shape {tuple(value.shape)} and dtype "
                    f"{value.dtype} in the checkpoint, but tx.init(params) makes "
                    f"{tuple(want.shape)} {want.dtype}.{_HINT}"
                )
            value = value.to(device if want.is_meta else want.device).clone()
            if report_lr and path.startswith(hyper) and not bool((value == want).all()):
                warnings.warn(
                    f"fg.load_state_dict: the checkpoint's hyperparameter at {path} is "
                    f"{float(value):.6g}, tx's is {float(want):.6g}. The checkpoint's is "
                    "restored: hyperparameters are part of the state. To train with tx's, "
                    "replace it: fg.set_hyperparams(state, name=value).",
                    stacklevel=3,
                )
            if hasattr(want, "placements"):  # a DTensor state (FSDP2): this rank's shard
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, want.device_mesh, want.placements)  # type: ignore[attr-defined]
            loaded.append(value)
        elif value != want:
            raise ValueError(
                f"fg.load_state_dict: {path} is {value!r} in the checkpoint, "
                f"expected {want!r}.{_HINT}"
            )
        else:
            loaded.append(want)
    state = optree.tree_unflatten(spec, loaded)
    check_invariants(state)
    return state if cut is None else cut(state)
