"""0-d float64 CPU tensors of a compiled step's state, handed to the graph as
1-element views, so that compiling the step traces it once.

Every optimizer state holds its learning rate as a 0-d float64 tensor (``lr``; on
the CPU beside CPU parameters). Dynamo gives each 0-d float64 CPU graph input a
float symbol for its value (fake tensors' ``item_memo``), and inductor's pass that
turns Python floats into tensors then finds a float symbol it did not make and
restarts the whole analysis once (``TensorifyScalarRestartAnalysis``, torch 2.13 and
2.14): the step is traced twice. Measured on the MLP 256-512-512-512-10 step with the
seed rule and Adam, cold: dynamo's tracing 3.3 s instead of 1.4 s, 456 captured calls
instead of 228 (docs/compile-notes.md).

A 1-element tensor gets no symbol. So the compiled step is called with each such
leaf replaced by a ``(1,)`` view of it, and the traced function puts ``view(())`` of
that view back in the leaf's place before anything reads the state: the same
storage, the same values, writes (donation) land in the caller's tensor, and the
leaf that would have made the symbol is never read by the trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..core._flat import Flat

Path = tuple[tuple[str, Any], ...]
"""Where a leaf sits: ``("attr", field)`` of a NamedTuple, ``("item", key)`` of a
tuple, list or dict, from the root down."""


def _is_scalar(t: Any) -> bool:
    return (
        type(t) is Tensor and t.dim() == 0 and t.dtype == torch.float64 and t.device.type == "cpu"
    )


def find(tree: Any, path: Path = ()) -> list[Path]:
    """The paths of the 0-d float64 CPU tensors in ``tree``: NamedTuples, plain tuples,
    lists and dicts are walked (a ``Flat``'s buffers are never 0-d; a leaf inside
    another container stays a 0-d input, correct but traced twice)."""
    if isinstance(tree, Tensor):
        return [path] if _is_scalar(tree) else []
    if isinstance(tree, Flat):
        return []
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return [p for f in tree._fields for p in find(getattr(tree, f), (*path, ("attr", f)))]
    if type(tree) in (tuple, list):
        return [p for i, x in enumerate(tree) for p in find(x, (*path, ("item", i)))]
    if type(tree) is dict:
        return [p for k, x in tree.items() for p in find(x, (*path, ("item", k)))]
    return []  # other containers are left alone: :func:`put` rebuilds only these


def get(tree: Any, path: Path) -> Any:
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def put(tree: Any, path: Path, value: Any) -> Any:
    """``tree`` with ``value`` at ``path``: the containers along the path rebuilt, the
    leaf that was there never read (so a trace does not make it a graph input)."""
    if not path:
        return value
    (kind, key), rest = path[0], path[1:]
    if kind == "attr":
        fields = [
            put(getattr(tree, f), rest, value) if f == key else getattr(tree, f)
            for f in tree._fields
        ]
        return type(tree)(*fields)
    if type(tree) in (tuple, list):
        return type(tree)([put(x, rest, value) if i == key else x for i, x in enumerate(tree)])
    return {k: put(x, rest, value) if k == key else x for k, x in tree.items()}


def lowered(fn: Callable[..., Any], donate: bool) -> Callable[..., Any]:
    """What is compiled: ``fn(params, state, *args)`` called as
    ``(params, state, paths, views, *args)``, each view put back 0-d at its path.
    Donated, the graph returns ``None`` in the params' and the state's places
    (:class:`Lifted` hands back the caller's own, which the graph wrote into):
    returning the rebuilt state would make its views outputs to regenerate, and its
    containers objects to rebuild, on every call."""

    def step(
        params: Any, state: Any, paths: tuple[Path, ...], views: tuple[Tensor, ...], *args: Any
    ) -> Any:
        for path, v in zip(paths, views, strict=True):
            state = put(state, path, v.view(()))
        out = fn(params, state, *args)
        return (None, None, *out[2:]) if donate else out

    return step


class Lifted:
    """Calls a :func:`lowered` compiled step with the state's 0-d float64 CPU leaves as
    ``(1,)`` views. The paths are found again when the inputs' structure is new
    (``fresh``) or a leaf at a known path is no longer such a tensor. A donated step
    returns the caller's own params and state (written into by the graph)."""

    def __init__(self, run: Callable[..., tuple[Any, ...]], donate: bool) -> None:
        self.run, self.donate = run, donate
        self.paths: tuple[Path, ...] | None = None

    def __call__(self, fresh: bool, params: Any, state: Any, *args: Any) -> tuple[Any, ...]:
        paths = None if fresh else self.paths
        try:
            found = [] if paths is None else [get(state, p) for p in paths]
        except (LookupError, AttributeError, TypeError):  # another structure
            paths = None
        if paths is None or not all(map(_is_scalar, found)):
            paths = self.paths = tuple(find(state))
            found = [get(state, p) for p in paths]
        out = self.run(fresh, params, state, paths, tuple(t.view(1) for t in found), *args)
        return (params, state, *out[2:]) if self.donate else out
