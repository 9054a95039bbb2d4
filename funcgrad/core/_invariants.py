"""What a transformation's state always satisfies, declared beside its type.

Each module that defines a state NamedTuple declares its invariants here
(``invariants(AdamState, count="nonnegative", mu="finite", ...)``); loading a
checkpoint (``fg.load_state_dict``, ``fg.load_checkpoint``) checks them, so a
damaged or diverged state is an error before anything is written. Kept apart from
the checkpoint code so that transformations import only this small registry.
"""

from __future__ import annotations

import optree
import torch
from torch import Tensor

from ._base import State
from ._tree import flatten

_INVARIANTS: dict[type, dict[str, str]] = {}
_CHECKS = {
    "finite": (lambda t: torch.isfinite(t).all(), "NaN or Inf values"),
    "nonnegative": (lambda t: (t >= 0).all(), "negative values"),
}


def invariants(state_type: type, **fields: str) -> None:
    """Declare what a state's fields always satisfy, checked by :func:`load_state_dict`.

    ``fields`` maps a field name to ``"finite"``, ``"nonnegative"`` or
    ``"finite nonnegative"``, e.g. ``invariants(AdamState, count="nonnegative",
    mu="finite", nu="finite nonnegative")``. Each module declares its own states'.
    """
    for name, kinds in fields.items():
        unknown = [k for k in kinds.split() if k not in _CHECKS]
        if unknown or name not in getattr(state_type, "_fields", ()):
            raise ValueError(f"invariants: bad declaration {name}={kinds!r}.")
    _INVARIANTS[state_type] = dict(fields)


def check_invariants(state: State) -> None:
    """Raise a clear error if a loaded state breaks what its types declared."""
    accessors, leaves, _ = flatten(state)
    for accessor, leaf in zip(accessors, leaves, strict=True):
        if not isinstance(leaf, Tensor):
            continue
        # The innermost NamedTuple field on the path (e.g. AdamState.nu for nu['w']).
        for entry in reversed(list(accessor)):
            if optree.is_namedtuple_class(entry.type):
                field = entry.type._fields[entry.entry]  # type: ignore[attr-defined]
                kinds = _INVARIANTS.get(entry.type, {}).get(field, "")
                break
        else:
            continue
        for kind in kinds.split():
            holds, broken = _CHECKS[kind]
            if leaf.numel() and not bool(holds(leaf)):
                raise ValueError(
                    f"fg.load_state_dict: {accessor.codify('state')} holds {broken}, which "
                    f"a {entry.type.__name__} never does (its {field} is {kind}). The "
                    "checkpoint is damaged, was edited, or was saved after the run had "
                    "already diverged; resume from an earlier checkpoint."
                )
