"""Data-parallel gradients: average across ``torch.distributed`` ranks inside the step.

DDP reduces gradients with autograd hooks during ``backward``; a funcgrad step has no
``backward`` call to hook into, so the reduction is a transformation instead. Put it
first in the chain so that per-group rules see the *global* gradient: a layer can be
all-zero on one rank's shard of the batch and not on the whole batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _compat
from ..core._base import EmptyState, Facts, GradientTransformation, Params, State
from ..core._compose import refuse_transforms


def initialized() -> bool:
    """Whether a ``torch.distributed`` process group is up: the one check funcgrad makes."""
    return dist.is_available() and dist.is_initialized()


class GroupRef:
    """A process group as the compiled step sees it: its name and size, read eagerly.

    A compiled step that reads a ``ProcessGroup`` object (``dist.group.WORLD``, or the
    group the user passed) keeps it alive for the life of the process, on torch 2.13
    and 2.14 alike, even after ``torch._dynamo.reset()``: ``destroy_process_group``
    then frees nothing, gloo's threads (and rank 0's store) run on into interpreter
    exit, where a gloo thread that takes the GIL during finalization aborts the
    process ("terminate called without an active exception", SIGABRT, after all the
    work is done). The functional collectives take the group's name instead, so the
    traced code reads only a string. The name and size are read outside the trace
    (``refresh``, called from ``init`` and on every eager call); a trace that finds
    none reads them itself (correct, and pins the group as before)."""

    def __init__(self, group: Any) -> None:
        # A weak reference: torch.distributed holds a live group; funcgrad's state
        # classes (module-level, for pickling) must not outlive it with it.
        self._group: Callable[[], Any] | None = None
        if group is not None:
            try:
                self._group = weakref.ref(group)
            except TypeError:  # not weakly referable (a stand-in): held as given
                self._group = lambda: group
        self.name: str | None = None
        self.world = 0

    @property
    def group(self) -> Any:
        """The group passed (``None``: the world), as ``torch.distributed`` takes it."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError(
                f"funcgrad: the process group {self.name!r} this transformation (or "
                "state) was built for no longer exists (destroy_process_group was "
                "called). Build the transformation and its state again for the new "
                "group: tx.init(params) after init_process_group / new_group."
            )
        return group

    def refresh(self) -> None:
        pg = self.process_group()
        self.name, self.world = pg.group_name, dist.get_world_size(pg)

    def resolved(self) -> tuple[str, int]:
        """``(name, world size)``: read now in eager code, the cached ones in a trace."""
        if self.name is None or not _compat.compiling():
            self.refresh()
        assert self.name is not None
        return self.name, self.world

    def process_group(self) -> Any:
        """The group object, for eager callers that need one (a ``DeviceMesh``)."""
        group = self.group
        return group if group is not None else dist.group.WORLD


def by_dtype(tree: Mapping[str, Tensor]) -> list[list[str]]:
    """The names of ``tree`` grouped by dtype, in order of first appearance: one
    bucket (one collective) per dtype."""
    out: dict[torch.dtype, list[str]] = {}
    for k, t in tree.items():
        out.setdefault(t.dtype, []).append(k)
    return list(out.values())


def _check_initialized(noop: bool) -> bool:
    """True when a process group is up; else raise, or return False if ``noop``."""
    if initialized():
        return True
    if noop:
        return False
    raise RuntimeError(
        "fg.all_reduce_mean: torch.distributed is not initialized, so there is nothing "
        "to average over. Call torch.distributed.init_process_group(...) first (torchrun "
        "sets the environment for init_process_group('gloo') or ('nccl')), or pass "
        "fg.all_reduce_mean(noop_if_not_initialized=True) to run the same code in a "
        "single process."
    )


def all_reduce_mean(
    group: Any = None, *, bucket: bool = True, noop_if_not_initialized: bool = False
) -> GradientTransformation:
    """Average gradients across the ranks of ``group`` (default: the world).

    Stateless, and traceable by ``torch.compile(fullgraph=True)``: it uses
    ``torch.distributed._functional_collectives``, which dynamo captures as graph ops.

    Args:
        group: a ``ProcessGroup`` (or anything functional collectives accept); ``None``
            means the default (world) group.
        bucket: flatten all gradients of one dtype into a single buffer and issue one
            collective instead of one per tensor (fewer, larger messages: faster on
            gloo: docs/distributed.md).
        noop_if_not_initialized: pass gradients through unchanged when no process
            group is initialized, instead of raising.

    Example (two processes, e.g. ``torchrun --nproc_per_node=2``)::

        tx = fg.chain(fg.all_reduce_mean(),
                      fg.per_group(fg.rules.zero_fix(), groups),
                      fg.adam())

    Runnable in one process (a group of one rank, where the mean is the gradient):

        >>> import torch, torch.distributed as dist, funcgrad as fg
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> try:
        ...     tx = fg.chain(fg.all_reduce_mean(), fg.adam(lr=0.1))
        ...     params = {"w": torch.ones(2)}
        ...     updates, _ = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        ... finally:
        ...     dist.destroy_process_group()
        >>> updates["w"]
        tensor([-0.1000,  0.1000])
    """
    fc = _compat.functional_collectives()
    ref = GroupRef(group)

    def reduce(grads: Params) -> Params:
        pg, world = ref.resolved()
        if not bucket:
            return {k: fc.all_reduce(g, "sum", pg) / world for k, g in grads.items()}
        out: Params = {}
        for names in by_dtype(grads):
            flat = torch.cat([grads[k].reshape(-1) for k in names])
            flat = fc.all_reduce(flat, "sum", pg) / world
            for k, piece in zip(names, flat.split([grads[k].numel() for k in names]), strict=True):
                out[k] = piece.view(grads[k].shape)
        return {k: out[k] for k in grads}

    def init(params: Params) -> EmptyState:
        if _check_initialized(noop_if_not_initialized):
            ref.refresh()
        return EmptyState()

    def update(grads: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        if not _check_initialized(noop_if_not_initialized) or not grads:
            return grads, state
        refuse_transforms("fg.all_reduce_mean", grads)
        return reduce(grads), state

    return GradientTransformation(init, update, Facts(averages=True))
