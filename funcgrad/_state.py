"""Checkpoints of transformation states as plain nested dicts of tensors.

``torch.load(weights_only=True)`` accepts dicts, lists, tensors and plain values
but not NamedTuples, so a state is written as nested dicts: a NamedTuple becomes
``{"_type": "AdamState", "count": ..., "mu": {...}}``, a tuple becomes
``{"_type": "tuple", "0": ..., "1": ...}``. Loading walks the structure that
``tx.init(params)`` makes and fills it, so any mismatch (another transformation,
another model, another shape or dtype) is named by its path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ._base import GradientTransformation, Params, State


def state_dict(state: State) -> dict[str, Any]:
    """A plain nested dict of tensors for ``state``, for ``torch.save``.

    Example:
        >>> import io, torch, funcgrad as fg
        >>> tx = fg.adam()
        >>> params = {"w": torch.ones(2)}
        >>> _, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> buf = io.BytesIO(); torch.save(fg.state_dict(state), buf); _ = buf.seek(0)
        >>> loaded = fg.load_state_dict(tx, params, torch.load(buf, weights_only=True))
        >>> int(loaded.count), torch.equal(loaded.mu["w"], state.mu["w"])
        (1, True)
    """
    out = _to_plain(state)
    if not isinstance(out, dict):
        out = {"_type": "value", "value": out}
    return out


def _to_plain(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {
            "_type": type(x).__name__,
            **{f: _to_plain(v) for f, v in zip(x._fields, x, strict=True)},
        }
    if isinstance(x, (tuple, list)):
        return {"_type": type(x).__name__, **{str(i): _to_plain(v) for i, v in enumerate(x)}}
    if isinstance(x, Mapping):
        bad = [k for k in x if not isinstance(k, str) or k == "_type"]
        if bad:
            raise TypeError(f"fg.state_dict: dict keys must be str (not '_type'), got {bad!r}.")
        return {k: _to_plain(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(
        f"fg.state_dict: cannot store a {type(x).__name__} in a checkpoint; states hold "
        "tensors in NamedTuples, tuples and dicts."
    )


def load_state_dict(
    tx: GradientTransformation, params: Params, state_dict: Mapping[str, Any]
) -> State:
    """Rebuild the state of ``tx`` from :func:`state_dict`'s output.

    The structure comes from ``tx.init(params)``; every tensor is checked for shape
    and dtype and copied onto the device of ``params``. Resuming from it continues
    bit for bit (see ``tests/test_reliability.py``).

    Raises:
        ValueError / KeyError / TypeError: naming the first path where the checkpoint
        and ``tx`` disagree.

    Example:
        >>> import torch, funcgrad as fg
        >>> params = {"w": torch.zeros(2)}
        >>> sd = fg.state_dict(fg.adam().init(params))
        >>> fg.load_state_dict(fg.adam(), params, sd).count
        tensor(0)
        >>> fg.load_state_dict(fg.adamw(amsgrad=True), params, sd)
        Traceback (most recent call last):
        ...
        KeyError: "fg.load_state_dict: state.nu_max names do not match: missing ['w'], ...
    """
    template = tx.init(params)
    if isinstance(state_dict, Mapping) and state_dict.get("_type") == "value":
        state_dict = state_dict["value"]
    return _fill(template, state_dict, "state")


def _kind(x: Any) -> str:
    if isinstance(x, Mapping):
        return str(x.get("_type", "dict"))
    return type(x).__name__


def _fill(template: Any, saved: Any, path: str) -> Any:
    hint = (
        " The checkpoint was made by another transformation or for another model; "
        "rebuild tx and params exactly as when it was saved."
    )
    if isinstance(template, Tensor):
        if not isinstance(saved, Tensor):
            raise TypeError(
                f"fg.load_state_dict: {path} should be a tensor, found {_kind(saved)}.{hint}"
            )
        if saved.shape != template.shape or saved.dtype != template.dtype:
            raise ValueError(
                f"fg.load_state_dict: {path} has shape {tuple(saved.shape)} and dtype "
                f"{saved.dtype} in the checkpoint, but tx.init(params) makes "
                f"{tuple(template.shape)} {template.dtype}.{hint}"
            )
        return saved.to(template.device).clone()
    if isinstance(template, (tuple, list)):
        name = type(template).__name__
        if not isinstance(saved, Mapping) or saved.get("_type") != name:
            raise TypeError(
                f"fg.load_state_dict: {path} should be a {name}, found {_kind(saved)}.{hint}"
            )
        fields = (
            template._fields
            if hasattr(template, "_fields")
            else [str(i) for i in range(len(template))]
        )
        extra = sorted(set(saved) - set(fields) - {"_type"})
        if extra:
            raise KeyError(f"fg.load_state_dict: {path} has unexpected entries {extra}.{hint}")
        items = []
        for f, t in zip(fields, template, strict=True):
            sep = f".{f}" if hasattr(template, "_fields") else f"[{f}]"
            if f not in saved:
                raise KeyError(
                    f"fg.load_state_dict: {path}{sep} is missing from the checkpoint.{hint}"
                )
            items.append(_fill(t, saved[f], path + sep))
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    if isinstance(template, Mapping):
        if not isinstance(saved, Mapping) or "_type" in saved:
            raise TypeError(
                f"fg.load_state_dict: {path} should be a dict, found {_kind(saved)}.{hint}"
            )
        missing = sorted(template.keys() - saved.keys())
        extra = sorted(saved.keys() - template.keys())
        if missing or extra:
            raise KeyError(
                f"fg.load_state_dict: {path} names do not match: missing {missing}, "
                f"unexpected {extra}.{hint}"
            )
        return {k: _fill(v, saved[k], f"{path}[{k!r}]") for k, v in template.items()}
    if template != saved:
        raise ValueError(
            f"fg.load_state_dict: {path} is {saved!r} in the checkpoint, "
            f"expected {template!r}.{hint}"
        )
    return template
