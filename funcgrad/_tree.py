"""Tiny pytree helpers that torch.compile traces without graph breaks.

optree is used for structure checks outside compiled code. Inside a traced step,
dynamo's optree polyfill cannot flatten NamedTuples created during tracing
("Unexpected type in sourceless builder", torch 2.13), so the step walks its
containers with plain Python, which dynamo unrolls for free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def leaves(tree: Any) -> list[Tensor]:
    """Tensors of ``tree`` in a deterministic order (dicts by insertion order)."""
    out: list[Tensor] = []
    _collect(tree, out)
    return out


def _collect(tree: Any, out: list[Tensor]) -> None:
    if isinstance(tree, Tensor):
        out.append(tree)
    elif isinstance(tree, Mapping):
        for v in tree.values():
            _collect(v, out)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            _collect(v, out)
