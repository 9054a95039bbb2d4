"""The statistics protocol: how a group statistic taken on this rank's rows combines
across ranks while ``fg.sharded`` runs a transformation on row shards.

``fg.sharded`` (funcgrad/distributed/_sharded.py) pushes its ranks (a :class:`Shards`)
with :func:`active`; every statistic that funcgrad's rules, ``fg.monitor``, the
clipping transforms, Adafactor and Muon take reads :func:`shards` and combines its
partial over them (funcgrad/rules/_rule_base.py). It lives below all of them, so that
optimizers and ``distributed`` reach it without importing ``rules``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

from torch import Tensor

Group = Mapping[str, Tensor]
T = TypeVar("T")


class Shards(Protocol):
    """How ``fg.sharded`` combines partial statistics (see the module docstring)."""

    def any(self, flag: Tensor) -> Tensor: ...
    def sum(self, partial: Tensor) -> Tensor: ...
    def numel(self, name: str) -> int: ...
    def on_whole(
        self, fn: Callable[[dict[str, Tensor]], dict[str, Tensor]], group: Group
    ) -> dict[str, Tensor]: ...
    def batched(self, fn: Callable[[], T]) -> T: ...


class _Active(threading.local):
    """Per thread: two threads stepping at once must not see each other's ranks."""

    def __init__(self) -> None:
        self.stack: list[Shards | None] = []


_ACTIVE = _Active()
"""The innermost entry of ``_ACTIVE.stack`` is in force: ``fg.sharded`` pushes its
ranks while ``tx`` runs on shards, and ``None`` while a rule runs on a group gathered
whole from all ranks (see :func:`active`)."""


def shards() -> Shards | None:
    """The ranks over which statistics combine now, or ``None`` (one process)."""
    stack = _ACTIVE.stack
    return stack[-1] if stack else None


@contextlib.contextmanager
def active(ranks: Shards | None) -> Iterator[None]:
    """Statistics combine over ``ranks`` inside the block (``None``: locally)."""
    _ACTIVE.stack.append(ranks)
    try:
        yield
    finally:
        _ACTIVE.stack.pop()


__all__ = ["Shards", "active", "shards"]
