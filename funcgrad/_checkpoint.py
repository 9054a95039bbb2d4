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
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._base import GradientTransformation, Params, State, check_floating, describe
from ._flat import layout_of, like
from ._shard import contains_sharded
from ._state import load_state_dict, state_dict
from ._tree import commit, names_mismatch

_MAGIC = b"funcgrad-checkpoint 1\n"


def save_checkpoint(
    path: str | os.PathLike[str], params: Params, state: State, **extra: Any
) -> None:
    """Write ``params``, ``state`` and ``extra`` to ``path`` atomically, with a checksum.

    Args:
        path: the file; its directory must exist. A previous file there is replaced
            only once the new one is completely on disk.
        params: the flat params dict (e.g. ``fg.params(model)``).
        state: the transformation's state.
        **extra: anything ``torch.load(weights_only=True)`` accepts back (numbers,
            strings, tensors, lists and dicts of them), e.g. ``epoch=3``.

    Example:
        >>> import tempfile, torch, funcgrad as fg
        >>> tx = fg.adam()
        >>> params = {"w": torch.ones(2)}
        >>> _, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> path = tempfile.mkdtemp() + "/ckpt.fg"
        >>> fg.save_checkpoint(path, params, state, epoch=3)
        >>> live = {"w": torch.zeros(2)}
        >>> live, state2, extra = fg.load_checkpoint(path, tx, live)
        >>> live["w"], int(state2.count), extra
        (tensor([1., 1.]), 1, {'epoch': 3})
    """
    check_floating(params, "fg.save_checkpoint: params")
    if contains_sharded(state):
        raise TypeError(
            "fg.save_checkpoint: the state is sharded across ranks (fg.sharded), and one "
            "process's file would hold only its rows. Save it with "
            "torch.distributed.checkpoint: dcp.save({'params': params, 'state': "
            "fg.state_dict(state)}, checkpoint_id=...) on every rank (docs/distributed.md)."
        )
    payload = {
        "params": {k: v.detach().clone() for k, v in params.items()},
        "state": state_dict(state),
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
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:  # the rename itself on disk
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


def load_checkpoint(
    path: str | os.PathLike[str], tx: GradientTransformation, params: Params
) -> tuple[Params, State, dict[str, Any]]:
    """Load a :func:`save_checkpoint` file into ``params`` and a new state for ``tx``.

    Everything is checked before anything is touched: the checksum, the parameter
    names, shapes and dtypes against ``params``, the state's structure against
    ``tx.init(params)`` and its invariants (finite moments, non-negative second
    moments and counters). Only then are the saved values written into the given
    ``params`` tensors (in place, so a module whose ``fg.params`` they are sees
    them), all at once.

    Returns:
        ``(params, state, extra)``: the same params dict, the loaded state, and the
        ``**extra`` given to :func:`save_checkpoint`.

    Example: see :func:`save_checkpoint`.
    """
    who = "fg.load_checkpoint"
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
    state = load_state_dict(tx, params, payload["state"])
    # (into flat params, one cat per buffer of the saved per-name tensors)
    commit(params, like({k: saved[k].to(params[k].device) for k in params}, layout_of(params)))
    return params, state, dict(payload["extra"])
