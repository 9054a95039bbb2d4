"""Combinators: transformations built from transformations (``chain``, ``named_chain``,
``partition``), as in optax's ``_combining.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from torch import Tensor

from ._base import GradientTransformation, Params, State, require_transformation, shardable
from ._tree import names_mismatch


class ChainState(NamedTuple):
    """The state of :func:`chain`: one inner state per transformation, in order."""

    inner_states: tuple[State, ...]


def _check_transforms(transforms: Sequence[GradientTransformation], who: str) -> None:
    for i, t in enumerate(transforms):
        require_transformation(t, f"{who}: argument {i}")


def _run_in_order(
    transforms: Sequence[GradientTransformation],
    grads: Params,
    states: Sequence[State],
    params: Params | None,
) -> tuple[Params, list[State]]:
    new_states = []
    for t, s in zip(transforms, states, strict=True):
        grads, s = t.update(grads, s, params)
        new_states.append(s)
    return grads, new_states


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; each sees the previous one's updates.

    Args:
        *transforms: the transformations, applied left to right.

    Returns:
        A transformation whose state is a :class:`ChainState`. To read an inner
        state by name rather than position, use :func:`named_chain`.

    Examples:
        >>> import torch, funcgrad as fg
        >>> groups = fg.Groups({"fc": ("fc.weight",)})
        >>> tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.1))
        >>> params = {"fc.weight": torch.zeros(2)}
        >>> updates, state = tx.update({"fc.weight": torch.zeros(2)}, tx.init(params), params)
        >>> updates["fc.weight"]  # all-zero group -> grads of 1.0 -> Adam's first step is -lr
        tensor([-0.1000, -0.1000])
    """
    _check_transforms(transforms, "fg.chain")

    def init(params: Params) -> ChainState:
        return ChainState(tuple(t.init(params) for t in transforms))

    def update(
        grads: Params, state: ChainState, params: Params | None = None
    ) -> tuple[Params, ChainState]:
        if not isinstance(state, ChainState) or len(state.inner_states) != len(transforms):
            raise TypeError(
                "fg.chain.update: got a state that this chain's init did not make "
                f"(got {type(state).__name__}). Build the state with tx.init(params) "
                "from the same transformation."
            )
        grads, new_states = _run_in_order(transforms, grads, state.inner_states, params)
        return grads, ChainState(tuple(new_states))

    tx = GradientTransformation(init, update)
    return shardable(tx, *transforms, by_entry=True, remake=lambda parts: chain(*parts))


def named_chain(*named: tuple[str, GradientTransformation]) -> GradientTransformation:
    """:func:`chain` whose state is a dict ``name -> inner state`` (optax's ``named_chain``).

    Args:
        *named: ``(name, transformation)`` pairs, applied left to right.

    Examples:
        >>> import torch, funcgrad as fg
        >>> groups = fg.Groups({"fc": ("fc.weight",)})
        >>> tx = fg.named_chain(("monitor", fg.monitor(groups)), ("adam", fg.adam(lr=0.1)))
        >>> params = {"fc.weight": torch.zeros(2)}
        >>> _, state = tx.update({"fc.weight": torch.zeros(2)}, tx.init(params), params)
        >>> state["monitor"].stats["fc"]["all_zero"], int(state["adam"].count)
        (tensor(True), 1)
    """
    for i, pair in enumerate(named):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(
                f"fg.named_chain: argument {i} must be a (name, transformation) pair, got "
                f"{type(pair).__name__}, e.g. fg.named_chain(('adam', fg.adam()))."
            )
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"fg.named_chain: names must be unique, got {names}.")
    transforms = [t for _, t in named]
    _check_transforms(transforms, "fg.named_chain")

    def init(params: Params) -> dict[str, State]:
        return {n: t.init(params) for n, t in named}

    def update(
        grads: Params, state: dict[str, State], params: Params | None = None
    ) -> tuple[Params, dict[str, State]]:
        if not isinstance(state, Mapping) or list(state) != names:
            got = list(state) if isinstance(state, Mapping) else type(state).__name__
            raise TypeError(
                f"fg.named_chain.update: got a state that this chain's init did not make "
                f"(expected a dict with names {names}, got {got}). Build the state with "
                "tx.init(params) from the same transformation."
            )
        grads, new = _run_in_order(transforms, grads, [state[n] for n in names], params)
        return grads, dict(zip(names, new, strict=True))

    def remake(parts: tuple[GradientTransformation, ...]) -> GradientTransformation:
        return named_chain(*zip(names, parts, strict=True))

    tx = GradientTransformation(init, update)
    return shardable(tx, *transforms, by_entry=True, remake=remake)


class PartitionState(NamedTuple):
    """The state of :func:`partition`: one inner state per label."""

    inner_states: dict[str, State]


def partition(
    transforms: Mapping[str, GradientTransformation],
    labels: Mapping[str, str] | Callable[[Params], Mapping[str, str]],
) -> GradientTransformation:
    """Send each parameter's gradient to the transformation of its label (optax-style).

    Each inner transformation sees only the sub-dict of its parameters.

    Args:
        transforms: ``label -> transformation``.
        labels: ``parameter name -> label``, or a function ``params -> that dict``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.partition({"train": fg.adam(lr=0.1), "frozen": fg.set_to_zero()},
        ...                   {"w": "train", "b": "frozen"})
        >>> params = {"w": torch.zeros(1), "b": torch.zeros(1)}
        >>> grads = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> updates, _ = tx.update(grads, tx.init(params), params)
        >>> updates
        {'w': tensor([-0.1000]), 'b': tensor([0.])}
    """
    transforms = dict(transforms)
    for k, t in transforms.items():
        require_transformation(t, f"fg.partition: transforms['{k}']")

    def resolve(params: Mapping[str, Tensor]) -> dict[str, str]:
        lab = dict(labels(dict(params)) if callable(labels) else labels)
        if lab.keys() != params.keys():
            raise KeyError(
                "fg.partition: labels must name every parameter exactly; the labels have "
                f"{names_mismatch(params, lab)}."
            )
        unknown = sorted({v for v in lab.values() if v not in transforms})
        if unknown:
            raise KeyError(
                f"fg.partition: labels {unknown} have no transformation. Known labels: "
                f"{sorted(transforms)}; add them to the transforms dict."
            )
        return lab

    def split(tree: Mapping[str, Tensor], lab: dict[str, str]) -> dict[str, Params]:
        parts: dict[str, Params] = {k: {} for k in transforms}
        for n, t in tree.items():
            parts[lab[n]][n] = t
        return parts

    def init(params: Params) -> PartitionState:
        parts = split(params, resolve(params))
        return PartitionState({k: t.init(parts[k]) for k, t in transforms.items()})

    def update(
        grads: Params, state: PartitionState, params: Params | None = None
    ) -> tuple[Params, PartitionState]:
        lab = resolve(grads if params is None else params)
        g_parts = split(grads, lab)
        p_parts = split(params, lab) if params is not None else None
        out: Params = {}
        new_states = {}
        for k, t in transforms.items():
            u, new_states[k] = t.update(
                g_parts[k], state.inner_states[k], None if p_parts is None else p_parts[k]
            )
            out.update(u)
        # Keep the caller's key order (dict order matters for pytree flattening).
        return {n: out[n] for n in grads}, PartitionState(new_states)

    def remake(parts: tuple[GradientTransformation, ...]) -> GradientTransformation:
        return partition(dict(zip(transforms, parts, strict=True)), labels)

    # by_entry: labels given as a function may decide from shapes (see fg.sharded)
    tx = GradientTransformation(init, update)
    return shardable(tx, *transforms.values(), by_entry=not callable(labels), remake=remake)


class ParamGroupsState(NamedTuple):
    """The state of :func:`by_groups` (``fg.grouped``): one inner state per param group,
    in the groups' order."""

    inner_states: tuple[State, ...]


def by_groups(
    transforms: Sequence[GradientTransformation], group_of: Mapping[str, int]
) -> GradientTransformation:
    """Send each parameter to the transformation of its param group: ``transforms[i]``
    sees the parameters ``n`` with ``group_of[n] == i`` (``fg.grouped`` builds it with
    one optimizer per group). Decided by name only, so it may see any subset of the
    named parameters (inside a ``partition``, say)."""
    transforms = tuple(transforms)
    _check_transforms(transforms, "fg.grouped")

    def split(tree: Mapping[str, Tensor]) -> list[Params]:
        parts: list[Params] = [{} for _ in transforms]
        for n, t in tree.items():
            i = group_of.get(n)
            if i is None:
                raise KeyError(
                    f"fg.grouped: parameter '{n}' is in no param group; every parameter "
                    f"the optimizer sees needs one (the groups name {len(group_of)})."
                )
            parts[i][n] = t
        return parts

    def init(params: Params) -> ParamGroupsState:
        return ParamGroupsState(
            tuple(t.init(p) for t, p in zip(transforms, split(params), strict=True))
        )

    def update(
        grads: Params, state: ParamGroupsState, params: Params | None = None
    ) -> tuple[Params, ParamGroupsState]:
        if not isinstance(state, ParamGroupsState) or len(state.inner_states) != len(transforms):
            raise TypeError(
                "fg.grouped.update: got a state that this transformation's init did not make "
                f"(got {type(state).__name__}); build it with tx.init(params)."
            )
        g_parts = split(grads)
        p_parts = split(params) if params is not None else [None] * len(transforms)
        out: Params = {}
        new = []
        for t, g, s, p in zip(transforms, g_parts, state.inner_states, p_parts, strict=True):
            u, s = t.update(g, s, p)
            out.update(u)
            new.append(s)
        return {n: out[n] for n in grads}, ParamGroupsState(tuple(new))

    tx = GradientTransformation(init, update)
    return shardable(
        tx, *transforms, by_entry=True, remake=lambda parts: by_groups(parts, group_of)
    )
