"""Data-parallel gradients: average across ``torch.distributed`` ranks inside the step.

DDP reduces gradients with autograd hooks during ``backward``; a funcgrad step has no
``backward`` call to hook into, so the reduction is a transformation instead. Put it
first in the chain so that per-group rules see the *global* gradient: a layer can be
all-zero on one rank's shard of the batch and not on the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _compat
from ..core._base import EmptyState, GradientTransformation, Params, State, averages_over_ranks
from ..core._compose import refuse_transforms


def initialized() -> bool:
    """Whether a ``torch.distributed`` process group is up: the one check funcgrad makes."""
    return dist.is_available() and dist.is_initialized()


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
            gloo; see ``benchmarks/bench_dist.py``).
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

    def reduce(grads: Params) -> Params:
        pg: Any = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
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
        _check_initialized(noop_if_not_initialized)
        return EmptyState()

    def update(grads: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        if not _check_initialized(noop_if_not_initialized) or not grads:
            return grads, state
        refuse_transforms("fg.all_reduce_mean", grads)
        return reduce(grads), state

    tx = GradientTransformation(init, update)
    averages_over_ranks(tx, mark=True)
    return tx
