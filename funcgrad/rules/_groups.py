"""Groups: which parameters a per-group rule looks at together.

Built once, in plain Python, outside any compiled code; per step funcgrad only
iterates over the (static) names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from torch import Tensor, nn

from ..core._base import is_int


class Groups(Mapping[str, tuple[str, ...]]):
    """An immutable mapping ``group name -> tuple of parameter names``.

    A parameter belongs to at most one group; parameters in no group are left
    untouched by :func:`funcgrad.per_group`.

    Examples:
        >>> import funcgrad as fg
        >>> g = fg.Groups({"fc1": ["fc1.weight", "fc1.bias"], "fc2": ["fc2.weight"]})
        >>> g["fc1"], len(g)
        (('fc1.weight', 'fc1.bias'), 2)
        >>> g.select("fc2")
        Groups({'fc2': ('fc2.weight',)})
    """

    def __init__(self, groups: Mapping[str, Iterable[str]]) -> None:
        data: dict[str, tuple[str, ...]] = {}
        owner: dict[str, str] = {}
        for gname, names in groups.items():
            if not isinstance(gname, str):
                raise TypeError(f"fg.Groups: group names must be str, got {gname!r}.")
            if isinstance(names, str):
                raise TypeError(
                    f"fg.Groups: group '{gname}' maps to the string {names!r}; give a "
                    f"sequence of parameter names instead, e.g. ({names!r},)."
                )
            names = tuple(names)
            if not names:
                raise ValueError(
                    f"fg.Groups: group '{gname}' is empty. Every group needs at least one "
                    "parameter name; drop the group instead."
                )
            for n in names:
                if n in owner:
                    raise ValueError(
                        f"fg.Groups: parameter '{n}' is in both group '{owner[n]}' and "
                        f"group '{gname}'. A parameter may belong to one group only, "
                        "otherwise the result would depend on the order of the groups."
                    )
                owner[n] = gname
            data[gname] = names
        self._data = data

    def __getitem__(self, key: str) -> tuple[str, ...]:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(
                f"fg.Groups: no group named '{key}'. Known groups: {list(self._data)}."
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Groups({self._data!r})"

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Groups):
            return self._data == other._data
        return NotImplemented

    def select(self, *group_names: str) -> Groups:
        """A ``Groups`` holding only the named groups; unknown names are an error."""
        unknown = [g for g in group_names if g not in self._data]
        if unknown:
            raise KeyError(
                f"fg.Groups.select: no group named {unknown}. Known groups: {list(self._data)}."
            )
        return Groups({g: self._data[g] for g in group_names})

    def check_against(self, names: Iterable[str], what: str) -> None:
        """Raise if a grouped parameter is not among ``names``."""
        known = set(names)
        for gname, members in self._data.items():
            for n in members:
                if n not in known:
                    raise KeyError(
                        f"{what}: group '{gname}' names parameter '{n}', which is not in "
                        f"the gradients. Known names: {sorted(known)}. Build groups from "
                        "the same model with fg.group_by_module(model)."
                    )


def as_groups(groups: Mapping[str, Sequence[str]] | Groups) -> Groups:
    return groups if isinstance(groups, Groups) else Groups(groups)


def group_by_module(
    model_or_params: nn.Module | Mapping[str, Tensor],
    *,
    types: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    depth: int | None = None,
) -> Groups:
    """Group parameters by the module that owns them.

    The default group of ``a.b.weight`` is its owning module path ``a.b`` (``""``
    for parameters owned by the root module). Groups keep the parameter order.

    Args:
        model_or_params: an ``nn.Module`` (its trainable parameters, as in
            :func:`funcgrad.params`), or a flat dict of parameters.
        types: only parameters owned *directly* by modules of these types are
            grouped (the rest stay in no group). Needs a model.
        depth: group by the first ``depth`` dotted components of the owning module
            path: ``encoder.layers.0.attn.q.weight`` with ``depth=3`` goes to
            ``encoder.layers.0``. Shorter paths are kept whole.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.ReLU(),
        ...                             torch.nn.Linear(2, 1))
        >>> fg.group_by_module(model)
        Groups({'0': ('0.weight', '0.bias'), '2': ('2.weight', '2.bias')})
        >>> fg.group_by_module(model, depth=1) == fg.group_by_module(model)
        True
    """
    if depth is not None and (not is_int(depth) or depth < 1):
        raise ValueError(
            f"fg.group_by_module: depth must be a positive int, got {depth!r}. "
            "depth=1 groups by top-level module, depth=2 by the next level, and so on."
        )
    if isinstance(model_or_params, nn.Module):
        model: nn.Module | None = model_or_params
        # fg.params' keys (not fg.params itself: that moves them into flat buffers)
        names = [n for n, p in model_or_params.named_parameters() if p.requires_grad]
    elif isinstance(model_or_params, Mapping):
        model = None
        names = list(model_or_params)
    else:
        raise TypeError(
            "fg.group_by_module: expected an nn.Module or a dict of parameters, got "
            f"{type(model_or_params).__name__}."
        )
    if types is not None:
        if model is None:
            raise TypeError(
                "fg.group_by_module: types= needs the model, since a dict of parameters "
                "does not say which module type owns each one. Call "
                "fg.group_by_module(model, types=(nn.Linear,)) instead of passing "
                "fg.params(model)."
            )
        type_tuple = types if isinstance(types, tuple) else (types,)
        for t in type_tuple:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise TypeError(
                    f"fg.group_by_module: types must be nn.Module subclasses, got {t!r}."
                )

    groups: dict[str, list[str]] = {}
    for name in names:
        owner = name.rpartition(".")[0]
        if types is not None:
            assert model is not None
            if not isinstance(model.get_submodule(owner), type_tuple):
                continue
        key = owner if depth is None else ".".join(owner.split(".")[:depth])
        groups.setdefault(key, []).append(name)
    return Groups(groups)
