"""Checkpoints that cannot silently corrupt a run.

``save_checkpoint`` writes params, state (:func:`funcgrad.state_dict`) and user extras
to a temporary file beside the target, fsyncs it and renames it over the target: a
crash mid-save leaves the previous checkpoint whole. The file is a header line, the
SHA-256 of the payload, and the payload as ``torch.save`` writes it; ``load_checkpoint``
verifies the checksum (a flipped byte or a truncated file is an error, never a
silently different moment), loads with ``weights_only=True``, checks names, shapes,
dtypes, structure and the state's invariants, and only then writes into the live
params, all at once.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import Tensor, nn

from .._compat import tree_map_only
from ..core._base import GradientTransformation, Params, State, check_floating, describe
from ..core._flat import layout_of, like
from ..core._tree import commit, names_mismatch
from ..distributed import _checkpoint as dckpt
from ..distributed._files import write_atomic
from ..distributed._sharded import ShardedState
from ._state_dict import load_state_dict, state_dict

if TYPE_CHECKING:  # for annotations only: funcgrad.torch_optim is the layer above
    from ..torch_optim import Optimizer

_MAGIC = b"funcgrad-checkpoint 1\n"


def _is_fg_optimizer(opt: Any) -> bool:
    """An ``fg.Optimizer``, known by the two methods a checkpoint calls
    (``_prepare``: check a loaded state, changing nothing; ``_commit``: adopt it), so
    this layer does not import the one above it."""
    return (
        isinstance(opt, torch.optim.Optimizer)
        and callable(getattr(opt, "_prepare", None))
        and callable(getattr(opt, "_commit", None))
    )


@overload
def save_checkpoint(
    path: str | os.PathLike[str], params: Params, state: State, **extra: Any
) -> None: ...
@overload
def save_checkpoint(
    path: str | os.PathLike[str], params: nn.Module, state: Optimizer, **extra: Any
) -> None: ...
def save_checkpoint(path: str | os.PathLike[str], params: Any, state: Any, **extra: Any) -> None:
    """Write ``params``, ``state`` and ``extra`` to ``path`` atomically, with a checksum.

    Args:
        path: the file; its directory must exist. A previous file there is replaced
            only once the new one is completely on disk. For a distributed checkpoint
            (below), a directory.
        params: the flat params dict (e.g. ``fg.params(model)``); or a model whose
            ``fg.Optimizer`` is ``state``.
        state: the transformation's state; or the model's ``fg.Optimizer``.
        **extra: anything ``torch.load(weights_only=True)`` accepts back (numbers,
            strings, tensors, lists and dicts of them), e.g. ``epoch=3``.

    A **distributed checkpoint** is written when the state is sharded
    (``fg.sharded``) or when ``params, state`` are a model and its ``fg.Optimizer``
    (FSDP2 models included); every rank calls it. ``path`` is then a directory: each
    save writes a new subdirectory with ``torch.distributed.checkpoint`` (one file per
    rank) and a manifest of SHA-256 checksums, and publishes it (``path/LATEST``,
    renamed into place) only once every rank has finished, so a save that dies leaves
    the previous checkpoint whole; older subdirectories are then removed.

    Examples:
        >>> import tempfile, torch, funcgrad as fg
        >>> tx = fg.adam()
        >>> params = {"w": torch.ones(2)}
        >>> _, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> path = tempfile.mkdtemp() + "/ckpt.fg"
        >>> fg.save_checkpoint(path, params, state, epoch=3)
        >>> live = {"w": torch.zeros(2)}
        >>> live, state2, extra = fg.load_checkpoint(path, live, tx)
        >>> live["w"], int(state2.count), extra
        (tensor([1., 1.]), 1, {'epoch': 3})
    """
    who = "fg.save_checkpoint"
    if isinstance(params, nn.Module) or _is_fg_optimizer(state):
        model, opt = _model_and_optimizer(params, state, who)
        tree = {"model": model.state_dict(), "opt": opt.state_dict()}
        dckpt.save(Path(path), tree, extra, who)
        return
    check_floating(params, "fg.save_checkpoint: params")
    saved = state_dict(state)  # refuses a ShardedState nested inside another state
    if isinstance(state, ShardedState):  # rows per rank: torch.distributed.checkpoint
        tree = {"params": dict(params), "state": saved}
        dckpt.save(Path(path), tree, extra, who)
        return
    payload = {
        "params": {k: v.detach().clone() for k, v in params.items()},
        "state": saved,
        "extra": extra,
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    try:  # what cannot be loaded back safely is refused now, not at resume time
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:
        raise TypeError(
            "fg.save_checkpoint: extra values must be numbers, strings, tensors, or lists "
            "and dicts of them, so that the checkpoint loads with "
            f"torch.load(weights_only=True); that refuses this one: {err}"
        ) from None
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(
            f"fg.save_checkpoint: the directory {str(target.parent)!r} does not exist; "
            "create it first."
        )
    blob = _MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data
    write_atomic(target, blob)


def _read(path: Path) -> dict[str, Any]:
    who = "fg.load_checkpoint"
    blob = path.read_bytes()
    if not blob.startswith(_MAGIC):
        raise ValueError(
            f"{who}: {str(path)!r} is not a checkpoint written by fg.save_checkpoint "
            "(its first line is not the funcgrad header)."
        )
    digest, _, data = blob[len(_MAGIC) :].partition(b"\n")
    if hashlib.sha256(data).hexdigest().encode() != digest:
        raise ValueError(
            f"{who}: {str(path)!r} is damaged: its SHA-256 checksum does not match its "
            f"contents ({len(data)} bytes after the header). The file was truncated or "
            "changed after it was written; load an earlier checkpoint."
        )
    payload = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(payload, Mapping) or set(payload) != {"params", "state", "extra"}:
        raise ValueError(f"{who}: {str(path)!r} has an unknown layout.")
    return dict(payload)


@overload
def load_checkpoint(
    path: str | os.PathLike[str], params: Params, tx: GradientTransformation
) -> tuple[Params, State, dict[str, Any]]: ...
@overload
def load_checkpoint(
    path: str | os.PathLike[str], params: nn.Module, tx: Optimizer
) -> tuple[nn.Module, Optimizer, dict[str, Any]]: ...
def load_checkpoint(
    path: str | os.PathLike[str], params: Any, tx: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """Load a :func:`save_checkpoint` file into ``params`` and a new state for ``tx``.

    The arguments come in :func:`save_checkpoint`'s order: ``(path, params, tx)``, or
    ``(path, model, opt)``. The order of earlier releases, ``(path, tx, params)`` /
    ``(path, opt, model)``, still works with a ``DeprecationWarning`` until the next
    release (a transformation or an ``fg.Optimizer`` second tells the two apart).

    Everything is checked before anything is touched: the checksum, the parameter
    names, shapes and dtypes against ``params``, the state's structure against
    ``tx.init(params)`` and its invariants (finite moments, non-negative second
    moments and counters). Only then are the saved values written into the given
    ``params`` tensors (in place, so a module whose ``fg.params`` they are sees
    them), all at once.

    A distributed checkpoint (a directory, see :func:`save_checkpoint`) is loaded by
    every rank, on any number of ranks (one process without a process group
    included): rank 0 verifies every file against the manifest, every rank reads its
    part into fresh tensors and validates it, and only when every rank has validated
    are the live params and state written. For a model and its ``fg.Optimizer``,
    pass ``(path, model, opt)``; the model's parameters and the optimizer's state are
    replaced, and ``(model, opt, extra)`` is returned.

    Returns:
        ``(params, state, extra)``: the same params dict, the loaded state, and the
        ``**extra`` given to :func:`save_checkpoint`.

    Example: see :func:`save_checkpoint`.
    """
    who = "fg.load_checkpoint"
    if isinstance(params, GradientTransformation) or _is_fg_optimizer(params):
        old, new = (
            ("(path, opt, model)", "(path, model, opt)")
            if _is_fg_optimizer(params)
            else ("(path, tx, params)", "(path, params, tx)")
        )
        warnings.warn(
            f"{who}{old} is the argument order of earlier releases; write {who}{new}, "
            "the order of fg.save_checkpoint. The old order works, with this warning, "
            "until the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        params, tx = tx, params
    if _is_fg_optimizer(tx) or isinstance(params, nn.Module):
        opt, model = tx, params
        _model_and_optimizer(model, opt, who)
        _must_be_directory(path, who)
        return _load_model_and_optimizer(Path(path), opt, model, who)
    if dckpt.is_distributed_checkpoint(path):
        return _load_distributed(Path(path), tx, params, who)
    payload = _read(Path(path))
    saved = payload["params"]
    if saved.keys() != params.keys():
        raise KeyError(
            f"{who}: the checkpoint's parameters are not these: it has "
            f"{names_mismatch(params, saved)}. Was it saved for another model?"
        )
    for k, live in params.items():
        s = saved[k]
        if not isinstance(s, Tensor) or s.shape != live.shape or s.dtype != live.dtype:
            raise ValueError(
                f"{who}: parameter '{k}' is {describe(s)} in the checkpoint and "
                f"{describe(live)} here. Was it saved for another model?"
            )
    _refuse_nonfinite(saved, who)
    state = load_state_dict(tx, params, payload["state"])
    # (into flat params, one cat per buffer of the saved per-name tensors)
    commit(params, like({k: saved[k].to(params[k].device) for k in params}, layout_of(params)))
    return params, state, dict(payload["extra"])


def _refuse_nonfinite(tensors: Any, who: str, whose: str = "") -> None:
    """A NaN or Inf parameter is an error before anything is written (the moments are
    checked by their invariants): resuming from it would train nothing but NaN."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or not t.is_floating_point():
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        if local.numel() and not bool(torch.isfinite(local).all()):
            raise ValueError(
                f"{who}: {whose or 'the'} parameter '{name}' holds NaN or Inf values in the "
                "checkpoint. It was saved after the run had diverged, or was damaged; "
                "resume from an earlier checkpoint. Nothing was changed."
            )


def _model_and_optimizer(model: Any, opt: Any, who: str) -> tuple[nn.Module, Optimizer]:
    if not (isinstance(model, nn.Module) and _is_fg_optimizer(opt)):
        raise TypeError(
            f"{who}: give a params dict and a state, or a model and its fg.Optimizer; got "
            f"{type(model).__name__} and {type(opt).__name__}."
        )
    mine = {id(p) for p in model.parameters()}
    if not all(id(p) in mine for g in opt.param_groups for p in g["params"]):
        raise ValueError(
            f"{who}: the fg.Optimizer was not built on this model's parameters; pass the "
            "model the optimizer trains."
        )
    return model, opt


def _must_be_directory(path: str | os.PathLike[str], who: str) -> None:
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"{who}: {str(path)!r} is not a distributed checkpoint directory; a model and "
            "its fg.Optimizer are saved by fg.save_checkpoint(path, model, opt) into one."
        )


def _fresh(tree: Any) -> Any:
    """The same tree with new tensors (DTensors stay DTensors of the same layout)."""
    return tree_map_only(Tensor, lambda t: t.detach().clone(), tree)


def _load_distributed(
    root: Path, tx: GradientTransformation, params: Params, who: str
) -> tuple[Params, State, dict[str, Any]]:
    check_floating(params, f"{who}: params")
    template = {"params": _fresh(dict(params)), "state": state_dict(tx.init(params))}
    tree, extra = dckpt.load(root, template, who)
    saved = tree["params"]
    box: list[State] = []

    def validate() -> None:
        _refuse_nonfinite(saved, who)
        box.append(load_state_dict(tx, params, tree["state"]))

    dckpt.raise_if_any(dckpt.guarded(validate))
    commit(params, like({k: saved[k].to(params[k].device) for k in params}, layout_of(params)))
    return params, box[0], dict(extra)


def _load_model_and_optimizer(
    root: Path, opt: Optimizer, model: nn.Module, who: str
) -> tuple[nn.Module, Optimizer, dict[str, Any]]:
    template = {"model": _fresh(model.state_dict()), "opt": _fresh(opt.state_dict())}
    tree, extra = dckpt.load(root, template, who)
    box: list[Any] = []

    def validate() -> None:
        names = {n for n, _ in model.named_parameters()}  # buffers may hold -inf masks
        _refuse_nonfinite(
            {k: v for k, v in tree["model"].items() if k in names}, who, "the model's"
        )
        box.append(opt._prepare(tree["opt"]))

    dckpt.raise_if_any(dckpt.guarded(validate))
    with torch.no_grad():
        model.load_state_dict(tree["model"])
    opt._commit(box[0])
    return model, opt, dict(extra)
