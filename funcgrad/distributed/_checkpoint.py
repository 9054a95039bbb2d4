"""Distributed checkpoints with the single-file guarantees (``fg.save_checkpoint`` of a
sharded state, or of a model and its ``fg.Optimizer`` on FSDP2).

A checkpoint is a directory ``root``. Each save writes a new subdirectory
``root/ckpt-NNNNNN-xxxxxxxx`` with ``torch.distributed.checkpoint`` (one file per
rank, fsynced), then rank 0 adds the user's extras (``extra.pt``) and a manifest
(``funcgrad-manifest.json``: the SHA-256 of every file), and only once every rank has
finished does it publish the subdirectory: ``root/LATEST`` names it, written to a
temporary file, fsynced and renamed over the old pointer. A save that dies anywhere
before that (a rank killed, a full disk) leaves ``LATEST`` naming the previous
checkpoint, whole. After publishing, the older subdirectories are removed.

A load reads ``LATEST``, verifies every file against the manifest on rank 0 (a flipped
byte or a truncated shard is an error before anything is read), reads into fresh
tensors (never into the live params or state), and returns them for the caller to
validate on every rank; the caller writes the live params and state only when every
rank validated its part. torch's ``CheckpointException`` (a ``BaseException``, which
``except Exception`` misses) arrives as a ``ValueError`` that says what to do.

Collectives use the default process group, as ``torch.distributed.checkpoint`` does;
without one (a single process), everything runs locally.

A sharded state's rows are saved whole. A state split in flat chunks is saved the same
way (each piece gathered whole, then cut into this rank's rows), so a checkpoint does
not depend on the split. In funcgrad/distributed/_whole.py, ``checkpoint_view`` turns
a ``ShardedState``'s row-split leaves into ``DTensor``s of their whole shapes for
``torch.distributed.checkpoint``
(``fg.state_dict``); ``whole_template`` gives ``fg.load_state_dict`` the whole
shapes to check a checkpoint against, and the function that cuts the loaded whole
state back to this rank's rows, so a checkpoint saved on 2 ranks loads on 3, or in one
process.

``torch.distributed.checkpoint`` is imported on first use (:func:`_dcp`): ``import
funcgrad`` does not load it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ._all_reduce import initialized
from ._files import sha256, write_atomic

POINTER = "LATEST"
MANIFEST = "funcgrad-manifest.json"
EXTRA = "extra.pt"
_FORMAT = "funcgrad-distributed-checkpoint 1"


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, imported on first use."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is
    what funcgrad asked for (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if initialized() else 0


def _from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_if_any(error: str | None, exc: type[Exception] = ValueError) -> None:
    """Every rank raises if any rank has an error (each names the first rank that has
    one), so no rank goes on to write live tensors while another stopped."""
    if initialized():
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    for rank, err in enumerate(errors):
        if err is not None:
            where = f" (rank {rank})" if initialized() else ""
            raise exc(f"{err}{where}")


def _files(sub: Path) -> list[str]:
    return sorted(
        str(p.relative_to(sub)) for p in sub.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def published(root: Path) -> str | None:
    """The name of the published subdirectory, or None when ``root`` has none."""
    pointer = root / POINTER
    if not pointer.is_file():
        return None
    return pointer.read_text().strip() or None


def is_distributed_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir()


def save(root: Path, tree: dict[str, Any], extra: dict[str, Any], who: str) -> None:
    """Save ``tree`` (a DCP state dict) and ``extra`` under ``root`` (collective).

    A rank that dies (or a collective that fails) at any point is an error on the ranks
    left that says whether this save was published and which checkpoint is the latest
    whole one (what ``root/LATEST`` names now), never gloo's bare connection error."""
    progress: dict[str, str] = {}
    try:
        _save(root, tree, extra, who, progress)
    except RuntimeError as err:  # gloo / NCCL: a peer died mid-collective
        raise RuntimeError(
            f"{who}: a collective failed while saving under {str(root)!r} ({_short(err)}), "
            f"a rank died or lost its connection; {_status(root, progress.get('name'))}. "
            "Restart every "
            "rank and resume with fg.load_checkpoint."
        ) from None


def _status(root: Path, name: str | None) -> str:
    """Whether the save ``name`` was published, and which checkpoint is whole."""
    now = published(root) if root.is_dir() else None
    if name is not None and now == name:
        return f"this save was published ({str(root / now)!r}, whole: LATEST names it)"
    if now is not None:
        return f"this save was not published; {str(root / now)!r} is the latest whole checkpoint"
    return "this save was not published, and no earlier checkpoint was"


def _save(
    root: Path, tree: dict[str, Any], extra: dict[str, Any], who: str, progress: dict[str, str]
) -> None:
    plan: tuple[str, str | None] | tuple[type[Exception], str] = (FileNotFoundError, "")
    if _rank() == 0:
        try:
            plan = _plan(root, extra, who)
        except (TypeError, FileNotFoundError, FileExistsError) as err:
            plan = (type(err), str(err))
    first, second = _from_rank0(plan)
    if isinstance(first, type):
        raise first(second)
    name, previous = first, second
    progress["name"] = name
    sub = root / name
    kept = (
        f"{str(root / previous)!r} is still the checkpoint that fg.load_checkpoint reads"
        if previous
        else "no checkpoint was published"
    )
    try:
        with _quiet():
            _dcp().save(
                tree, storage_writer=_dcp().FileSystemWriter(sub), no_dist=not initialized()
            )
    except (_checkpoint_exception(), OSError, RuntimeError) as err:
        raise ValueError(
            f"{who}: torch.distributed.checkpoint failed to write {str(sub)!r} "
            f"({_short(err)}); {kept}. Fix the cause (a rank that died, a full disk, a "
            "directory that not every rank sees) and save again."
        ) from None
    failure = None
    if _rank() == 0:
        try:
            _publish(root, sub, extra)
        except OSError as err:
            failure = f"{who}: publishing {str(sub)!r} failed ({err}); {kept}."
    failure = _from_rank0(failure)  # also: no rank returns before it is published
    if failure is not None:
        raise OSError(failure)


def _plan(root: Path, extra: dict[str, Any], who: str) -> tuple[str, str | None]:
    """Rank 0: check ``extra`` and ``root``; the new subdirectory's name and the
    published one's."""
    buf = io.BytesIO()
    torch.save(extra, buf)
    try:  # what cannot be loaded back safely is refused now, not at resume time
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as err:
        raise TypeError(
            f"{who}: extra values must be numbers, strings, tensors, or lists and dicts "
            "of them, so that the checkpoint loads with torch.load(weights_only=True); "
            f"that refuses this one: {err}"
        ) from None
    if not root.parent.is_dir():
        raise FileNotFoundError(
            f"{who}: the directory {str(root.parent)!r} does not exist; create it first."
        )
    if root.exists() and not root.is_dir():
        raise FileExistsError(
            f"{who}: {str(root)!r} is a file; a distributed checkpoint is a directory "
            "(each rank writes its own file into it). Choose another path."
        )
    root.mkdir(exist_ok=True)
    previous = published(root)
    number = int(previous.split("-")[1]) + 1 if previous else 1
    return f"ckpt-{number:06d}-{uuid.uuid4().hex[:8]}", previous


def _publish(root: Path, sub: Path, extra: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(extra, buf)
    write_atomic(sub / EXTRA, buf.getvalue())
    manifest = {"format": _FORMAT, "files": {f: sha256(sub / f) for f in _files(sub)}}
    write_atomic(sub / MANIFEST, json.dumps(manifest, indent=1).encode())
    write_atomic(root / POINTER, (sub.name + "\n").encode())  # the commit point
    for old in root.iterdir():  # older checkpoints and unfinished saves
        if old.is_dir() and old.name.startswith("ckpt-") and old.name != sub.name:
            shutil.rmtree(old, ignore_errors=True)


def load(root: Path, fresh: dict[str, Any], who: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify the published checkpoint under ``root`` and read it into ``fresh`` (a DCP
    state dict of new tensors, laid out as this process wants them); collective.
    Returns ``(fresh, extra)``."""
    found: tuple[str | None, Any, str | None] = (None, None, None)
    if _rank() == 0:
        found = _verify(root, who)
        if found[2] is None:
            found = (*found[:2], _check_keys(root / str(found[0]), fresh, who))
    name, extra, error = _from_rank0(found)
    if error is not None:
        raise ValueError(error)
    assert name is not None
    sub = root / name
    _drop_missing_lr(fresh, _saved_keys(sub))
    try:
        with _quiet():
            _dcp().load(
                fresh, storage_reader=_dcp().FileSystemReader(sub), no_dist=not initialized()
            )
    except (_checkpoint_exception(), OSError, RuntimeError, ValueError, KeyError) as err:
        raise ValueError(
            f"{who}: torch.distributed.checkpoint could not read {str(sub)!r} into this "
            f"model's layout ({_short(err)}). Was it saved for another model or "
            "transformation? Nothing was changed."
        ) from None
    return fresh, extra


def _terminal(value: Any) -> bool:
    """torch.distributed.checkpoint's rule (``_traverse.traverse_state_dict``, torch
    2.13-2.14): a dict is walked; a list only when it holds a tensor or a walked
    container; anything else (a tuple too) is one entry."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(
        isinstance(v, torch.Tensor) or (isinstance(v, (dict, list)) and not _terminal(v))
        for v in value
    )


def _keys(tree: Any, prefix: str = "") -> Iterator[str]:
    """The keys torch.distributed.checkpoint flattens ``tree`` to (joined with dots,
    as its metadata names them)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _keys(v, f"{prefix}.{k}" if prefix else str(k))
    elif _terminal(tree):
        yield prefix
    else:
        for i, v in enumerate(tree):
            yield from _keys(v, f"{prefix}.{i}")


def _saved_keys(sub: Path) -> set[str]:
    return set(_dcp().FileSystemReader(sub).read_metadata().state_dict_metadata)


def _old_hyper(key: str, saved: set[str]) -> bool:
    """An entry of an optimizer state's ``hyperparams`` that a checkpoint written before
    every hyperparameter was state does not hold (its ``count`` is there, its
    ``hyperparams`` not): it starts as tx.init makes it. (Its ``lr``, if any, was the
    learning rate or a schedule's factor: tx's learning rate is used.)"""
    head, found, _ = key.partition(".hyperparams")
    if not found or f"{head}.count" not in saved:
        return False
    return not any(k.startswith(f"{head}.hyperparams") for k in saved)


def _old_lr(key: str, saved: set[str]) -> bool:
    """A saved optimizer state's ``lr`` of such a checkpoint."""
    return key.endswith(".lr") and key[: -len("lr")] + "count" in saved


def _drop_missing_lr(tree: Any, saved: set[str], prefix: str = "") -> None:
    if isinstance(tree, dict):
        for k in list(tree):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k == "hyperparams" and _old_hyper(f"{key}.", saved):
                del tree[k]
            else:
                _drop_missing_lr(tree[k], saved, key)


def _check_keys(sub: Path, fresh: dict[str, Any], who: str) -> str | None:
    """Rank 0: the checkpoint holds exactly the entries of this model and
    transformation (torch.distributed.checkpoint alone loads a subset model silently,
    dropping the saved layers that are not there)."""
    try:
        saved = _saved_keys(sub)
    except Exception as err:
        return f"{who}: {str(sub)!r} has no readable metadata ({_short(err)}); load an earlier one."
    want = set(_keys(fresh))
    extra = sorted(k for k in saved - want if not _old_lr(k, saved))
    missing = sorted(k for k in want - saved if not _old_hyper(k, saved))
    if not extra and not missing:
        return None
    parts = []
    if extra:
        parts.append(f"entries this one does not have: {', '.join(extra[:6])}")
    if missing:
        parts.append(f"no entries for: {', '.join(missing[:6])}")
    more = len(extra) + len(missing) - len(extra[:6]) - len(missing[:6])
    return (
        f"{who}: the checkpoint was saved for another model or transformation; it holds "
        f"{'; and '.join(parts)}{f' (and {more} more)' if more > 0 else ''}. Build the "
        "model and tx exactly as when saving. Nothing was changed."
    )


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) < 400 else text[:400] + "..."


def _verify(root: Path, who: str) -> tuple[str | None, Any, str | None]:
    name = published(root)
    if name is None:
        return (
            None,
            None,
            (
                f"{who}: {str(root)!r} holds no published checkpoint (no {POINTER} file): "
                "no save finished there."
            ),
        )
    sub = root / name
    try:
        manifest = json.loads((sub / MANIFEST).read_text())
        files = manifest["files"]
        assert manifest["format"] == _FORMAT and isinstance(files, dict)
    except (OSError, ValueError, KeyError, AssertionError, TypeError):
        return (
            None,
            None,
            (
                f"{who}: {str(sub)!r} has no readable manifest ({MANIFEST}); the checkpoint "
                "is damaged. Load an earlier one."
            ),
        )
    unlisted = sorted(set(_files(sub)) - set(files))
    required = [f for f in (".metadata", EXTRA) if f not in files]
    if unlisted or required:
        return (
            None,
            None,
            (
                f"{who}: the manifest of {str(sub)!r} does not list "
                f"{', '.join(unlisted + required)}, so those files cannot be verified; the "
                "checkpoint is damaged or was edited. Load an earlier one."
            ),
        )
    for f, digest in files.items():
        path = sub / f
        if not path.is_file():
            return (
                None,
                None,
                (f"{who}: {str(path)!r} is missing from the checkpoint; load an earlier one."),
            )
        if sha256(path) != digest:
            return (
                None,
                None,
                (
                    f"{who}: {str(path)!r} is damaged: its SHA-256 checksum does not match the "
                    "manifest. The file was truncated or changed after it was written; load an "
                    "earlier checkpoint."
                ),
            )
    try:
        extra = torch.load(sub / EXTRA, weights_only=True)
    except Exception as err:
        return None, None, f"{who}: {str(sub / EXTRA)!r} cannot be read ({err})."
    return name, extra, None


def guarded(fn: Callable[[], Any]) -> str | None:
    """Run a validation on this rank; its error's text, or None."""
    try:
        fn()
    except (ValueError, KeyError, TypeError) as err:
        return str(err.args[0]) if err.args else str(err)
    return None
