"""A sharded state's rows, viewed whole: :func:`checkpoint_view` turns a
``ShardedState``'s row-split leaves into ``DTensor``s of their whole shapes for
``torch.distributed.checkpoint`` (``fg.state_dict``); :func:`whole_template` gives
``fg.load_state_dict`` the whole shapes to check a checkpoint against, and the function
that cuts the loaded whole state back to this rank's rows; :func:`full_tensors` and
:func:`copied_dtensor` bring DTensors (FSDP2's) to plain whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from ..core._base import State
from ..core._tree import flatten
from ._sharded import Layout, ShardedState
from ._split import Chunks, Ranks, Rows


def _layout_of(state: ShardedState, who: str) -> Layout:
    layout: Layout | None = getattr(type(state), "layout", None)
    if layout is None:
        raise ValueError(f"{who}: this ShardedState was not made by fg.sharded(...).init.")
    return layout


def checkpoint_view(state: ShardedState) -> State:
    """``state.inner`` with each row-split leaf as a ``DTensor`` of its whole shape
    (``Shard(0)`` over the group), for ``torch.distributed.checkpoint``; a leaf of a 0-d
    parameter is gathered to every rank as a plain 0-d tensor. Collective."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    layout = _layout_of(state, "fg.state_dict")
    ranks = layout.ranks
    _, leaves, spec = flatten(state.inner)
    if len(leaves) != len(layout.whole):
        raise ValueError("fg.state_dict: the ShardedState does not match its layout.")
    mesh = DeviceMesh.from_group(ranks.ref.process_group(), layout.device.type)
    saved = _saved_chunks if isinstance(ranks, Chunks) else _saved_rows
    out: list[Any] = []
    for leaf, whole, name in zip(leaves, layout.whole, layout.names, strict=True):
        if whole is None:
            out.append(leaf)
            continue
        mine = saved(ranks, leaf, whole, name)  # type: ignore[arg-type]
        if len(whole) == 0:  # a 0-d parameter's: the value itself, on every rank
            out.append(mine)
            continue
        stride = torch.empty(whole, device="meta").stride()
        out.append(
            DTensor.from_local(
                mine, mesh, [Shard(0)], run_check=False, shape=torch.Size(whole), stride=stride
            )
        )
    return optree.tree_unflatten(spec, out)


def _saved_rows(ranks: Ranks, leaf: Tensor, whole: tuple[int, ...], name: str | None) -> Tensor:
    """What this rank saves of a leaf split by rows: its rows; a 0-d parameter's (whose
    one row rank 0 holds) the value, broadcast. Collective for 0-d ones."""
    if len(whole) == 0:
        value = leaf.reshape(()).clone() if ranks.rank == 0 else leaf.new_empty(())
        dist.broadcast(value, group_src=0, group=ranks.group)
        return value
    return leaf.contiguous()


def _saved_chunks(ranks: Chunks, leaf: Tensor, whole: tuple[int, ...], name: str | None) -> Tensor:
    """What this rank saves of a piece of a flat chunk: the whole tensor gathered, then
    this rank's rows of it, so the checkpoint is the same as by rows (and loads into
    either split). Collective."""
    value = ranks.gather_names({str(name): leaf})[str(name)]
    return (value if len(whole) == 0 else Rows(whole, ranks.rank, ranks.world).local(value)).clone()


def whole_template(state: ShardedState) -> tuple[State, Callable[[State], ShardedState]]:
    """The unsharded shape of ``state.inner`` (row-split leaves as ``meta`` tensors of
    their whole shapes), and the function that cuts a loaded whole state back to this
    rank's rows."""
    layout = _layout_of(state, "fg.load_state_dict")
    ranks = layout.ranks
    rank, world = ranks.rank, ranks.world
    _, leaves, spec = flatten(state.inner)
    template = [
        leaf if whole is None else torch.empty(whole, dtype=leaf.dtype, device="meta")
        for leaf, whole in zip(leaves, layout.whole, strict=True)
    ]

    def piece(value: Any, whole: tuple[int, ...] | None, name: str | None) -> Any:
        if whole is None:
            return value
        if isinstance(ranks, Chunks):
            a, e = ranks.piece(rank, name)  # type: ignore[arg-type]
            return value.reshape(-1)[a:e].clone()
        return Rows(whole, rank, world).local(value).clone()

    def cut(whole_state: State) -> ShardedState:
        _, loaded, _ = flatten(whole_state)
        mine = [piece(*leaf) for leaf in zip(loaded, layout.whole, layout.names, strict=True)]
        return type(state)(optree.tree_unflatten(spec, mine))

    return optree.tree_unflatten(spec, template), cut


def contains_sharded(tree: Any) -> bool:
    """Whether a state holds a :class:`ShardedState` anywhere."""
    if isinstance(tree, ShardedState):
        return True
    if isinstance(tree, Mapping):
        return any(contains_sharded(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return any(contains_sharded(v) for v in tree)
    return False


def copied_dtensor(x: Any) -> Any:
    """A copy of a ``DTensor`` made on its local tensor, for fg.state_dict: a DTensor
    op would enter torch's sharding caches, which keep the mesh, and so its process
    group, alive after ``destroy_process_group`` (docs/distributed.md, "At exit")."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        x.to_local().detach().clone(),
        x.device_mesh,
        x.placements,
        run_check=False,
        shape=x.shape,
        stride=x.stride(),
    )


def _whole(x: Any) -> Tensor:
    """``x.full_tensor()`` for a DTensor split by rows (``Shard(0)``) or replicated on
    a 1-D mesh (what fg.state_dict writes), gathered without a DTensor op (as
    :func:`copied_dtensor` copies). Other layouts go through ``full_tensor``.
    Collective."""
    from torch.distributed.tensor import Replicate, Shard

    local = x.to_local()
    if x.device_mesh.ndim != 1 or len(x.placements) != 1:
        return x.full_tensor()
    (placement,) = x.placements
    if isinstance(placement, Replicate):
        return local
    if not (isinstance(placement, Shard) and placement.dim == 0 and x.ndim > 0):
        return x.full_tensor()
    world = x.device_mesh.size()
    rows = -(-x.shape[0] // world)  # torch.chunk's: the last ranks may hold fewer
    mine = max(0, min(rows, x.shape[0] - x.device_mesh.get_local_rank() * rows))
    if local.shape[0] != mine:  # on every rank alike: the same shape, the same split
        return x.full_tensor()
    padded = local.new_zeros((rows, *x.shape[1:]))
    padded[: local.shape[0]] = local
    every = local.new_empty((rows * world, *x.shape[1:]))
    dist.all_gather_single(every, padded, group=x.device_mesh.get_group())
    return every[: x.shape[0]].clone()


def full_tensors(tree: Any) -> Any:
    """Replace every ``DTensor`` in a nested dict by its whole tensor (collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return _whole(tree)
    if isinstance(tree, Mapping):
        return {k: full_tensors(v) for k, v in tree.items()}
    return tree
