"""Tiny pytree helpers that torch.compile traces without graph breaks.

Inside a traced step, dynamo's optree polyfill cannot flatten NamedTuples created
during tracing ("Unexpected type in sourceless builder", torch 2.13), so the step
walks its containers with plain Python, which dynamo unrolls for free. Dicts are
walked in insertion order (optree would sort their keys), so error messages name
entries in the user's order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor


def leaves_with_paths(tree: Any, prefix: str = "") -> list[tuple[str, Tensor]]:
    """``(path, tensor)`` pairs, e.g. ``("[1].mu['fc1.weight']", t)``."""
    if isinstance(tree, Tensor):
        return [(prefix, tree)]
    out: list[tuple[str, Tensor]] = []
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out += leaves_with_paths(v, f"{prefix}[{k!r}]")
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for k, v in zip(tree._fields, tree, strict=True):
            out += leaves_with_paths(v, f"{prefix}.{k}")
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            out += leaves_with_paths(v, f"{prefix}[{i}]")
    return out


def map2(fn: Callable[[Tensor, Tensor], Any], a: Any, b: Any) -> Any:
    """``fn(x, y)`` for each pair of tensors of two trees of the same structure.

    Dict entries are matched by key (not position); NamedTuples, tuples and lists are
    rebuilt with the results; other leaves of ``a`` are kept as they are.
    """
    if isinstance(a, Tensor):
        return fn(a, b)
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(map2(fn, x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, (tuple, list)):
        return type(a)(map2(fn, x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping):
        return {k: map2(fn, v, b[k]) for k, v in a.items()}
    return a


def copy_into(dst: Any, src: Any) -> None:
    """``dst.copy_(src)`` leaf by leaf, matching dict entries by key (not position)."""
    map2(lambda d, s: d.copy_(s), dst, src)
