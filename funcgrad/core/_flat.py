"""One flat layout: parameters, gradients and optimizer state in a few contiguous buffers.

:class:`Flat` is a read-only ``Mapping[str, Tensor]`` whose entries are views into
one contiguous 1-D buffer per (device, dtype) (on the CPU, buffers of at most
:data:`CPU_BUCKET_BYTES`, and a tensor of :data:`CPU_ALONE_BYTES` or more alone), in
``named_parameters()`` order, so each module's own parameters (a group of
``fg.group_by_module``) are one segment where they share a buffer.
A user reads it as a dict (``params["fc1.weight"]``, ``state.mu["fc1.weight"]``,
checkpoints keyed by name, as before); the code that runs every step sees a few
buffers instead of one tensor per parameter:

- as a pytree in ``torch.utils._pytree`` (and optree's ``funcgrad.buffers``
  namespace, which funcgrad's commit and step checks use) its leaves are the
  buffers, so a compiled step has a few inputs and a ``tree_map`` over it is one
  elementwise op per buffer;
- in optree's ``funcgrad`` namespace (checks, messages, checkpoints) and its global
  one (a user's ``optree.tree_map``) its children are the per-name views, so paths
  read ``mu['fc1.weight']`` and a checkpoint has today's names and shapes (loaded
  back into the flat layout).

Why: ``torch.compile`` generates and compiles code per tensor, so a step over many
small layers compiled several times as long as its gradients with one tensor per
parameter (docs/compile-notes.md); Adam over three flat buffers is one kernel.

:func:`funcgrad.params` builds it from a module and makes the module's parameters
views of its buffers (``param.data = view``), so the module and the dict stay one
set of tensors; :meth:`Flat.check_attached` finds a module whose parameters were
re-allocated since (``model.to(dtype)``, ``to_empty``, an assignment to ``.data``).
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn

from .. import _compat
from .._compat import compiling
from ._layout import Layout
from ._scratch import BIG, borrowing
from ._tree import BUFFERS, NAMESPACE


class Flat(Mapping[str, Tensor]):
    """A read-only mapping ``name -> view`` over flat buffers (one per (device, dtype);
    on the CPU, at most :data:`CPU_BUCKET_BYTES` each, a large tensor alone).

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> p = fg.params(model)
        >>> type(p).__name__, list(p), [tuple(b.shape) for b in p.buffers]
        ('Flat', ['weight', 'bias'], [(3,)])
        >>> p["weight"].data_ptr() == model.weight.data_ptr()
        True
    """

    __slots__ = ("_owner", "_parts", "_views", "buffers", "layout")

    buffers: tuple[Tensor, ...]
    layout: Layout

    def __init__(
        self, buffers: Sequence[Tensor], layout: Layout, owner: tuple[Any, ...] | None = None
    ) -> None:
        self.buffers = tuple(buffers)
        self.layout = layout
        self._views: dict[str, Tensor] | None = None
        self._owner = owner
        self._parts: Mapping[str, Tensor] | None = None

    @classmethod
    def _packed_from(cls, parts: Mapping[str, Tensor], layout: Layout) -> Flat:
        """``pack(parts, layout)`` that keeps ``parts`` (in traced code only), for
        :meth:`_parts_in`.

        Under inductor on the CPU a ``cat`` is always a buffer written whole
        (``ConcatKernel``), so the flat gradient costs one more pass over every
        gradient; when the rules read the per-name gradients (the backward's own
        outputs, where their reductions fuse) and nothing else reads the flat
        buffer, that ``cat`` is dead code and inductor drops it. ``parts`` must not
        change afterwards (a traced step's gradients do not)."""
        flat = pack(parts, layout)
        if flat is not parts and compiling():
            flat._parts = parts
        return flat

    def _parts_in(self, b: int, start: int, stop: int) -> dict[str, Tensor] | None:
        """The kept parts (:meth:`_packed_from`) that tile entries ``[start, stop)`` of
        buffer ``b`` exactly, by name in order; None if none are kept or they do
        not tile that range (then read the buffer)."""
        buf = self.buffers[b]
        parts = self._parts
        names = None if parts is None or buf.dim() != 1 else self.layout.run(b, start, stop)
        if names is None:
            return None
        run = {n: parts[n] for n in names}  # type: ignore[index]
        for n, part in run.items():
            shape = self.layout.entries[self.layout.index[n]][2]
            if part.dtype != buf.dtype or part.shape != shape:
                return None
        return run

    def _entries(self, b: int, start: int, stop: int) -> dict[str, Tensor]:
        """Entries ``[start, stop)`` of buffer ``b`` as a group for a rule or a
        statistic: the kept per-name parts that tile them (:meth:`_parts_in`), else
        ``{"segment": the slice of the buffer}``."""
        parts = self._parts_in(b, start, stop)
        return parts if parts is not None else {"segment": self.buffers[b][start:stop]}

    def _has_parts(self) -> bool:
        """Whether this keeps the per-name tensors it was packed from (:meth:`_packed_from`)."""
        return self._parts is not None

    # The mapping: views made on first use (and kept, outside traced code).
    def views(self) -> dict[str, Tensor]:
        """Every entry as a view of its buffer, in order (a new plain dict).

        Eagerly the views are made once per object and kept (the same view objects
        every time); traced, they are made from the buffers inside the graph, never
        read from that cache (cached views would become extra, aliased graph inputs:
        slower guards and runtime wrappers)."""
        traced = compiling()
        # The cache is not read while tracing: dynamo would guard on whether it is
        # filled, and a step's output (not yet viewed) would recompile the step.
        if not traced and self._views is not None:
            return dict(self._views)
        out = {
            n: _view(self.buffers[b], o, s)
            for n, (b, o, s) in zip(self.layout.names, self.layout.entries, strict=True)
        }
        if not traced:
            self._views = out
        return dict(out)

    def __getitem__(self, name: str) -> Tensor:
        if not compiling():
            if self._views is None:
                self.views()
            return self._views[name]  # type: ignore[index]
        i = self.layout.index.get(name) if isinstance(name, str) else None
        if i is None:
            raise KeyError(name)
        b, o, s = self.layout.entries[i]
        return _view(self.buffers[b], o, s)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.index

    def __repr__(self) -> str:
        return f"Flat({self.views()!r})"

    def __reduce__(self) -> Any:
        # pickle / torch.save: an OrderedDict of per-name tensors (what a module's
        # state_dict is), which torch.load(weights_only=True) accepts, and which loads
        # into either layout
        return (collections.OrderedDict, (list(self.views().items()),))

    def __deepcopy__(self, memo: dict[int, Any]) -> Flat:
        return Flat([b.clone() for b in self.buffers], self.layout)

    def _detached_name(self) -> str | None:
        """The first parameter of the module this came from that is no longer a view
        of these buffers, or None."""
        if self._owner is None:
            return None
        model_ref, refs, ptrs = self._owner
        if model_ref() is None:
            return None  # the module is gone: nothing to keep in step with
        for (name, ref), ptr in zip(refs, ptrs, strict=True):
            p = ref()
            if p is None or p.data_ptr() != ptr:
                return name
        return None

    def attached(self) -> bool:
        return self._detached_name() is None

    def check_attached(self, what: str) -> None:
        """Raise if the module this came from no longer trains these buffers."""
        name = self._detached_name()
        if name is not None:
            raise RuntimeError(
                f"{what}: the module's parameter '{name}' is no longer the tensor that "
                "these params hold: it was re-allocated after fg.params(model) (by "
                "model.to(...), .half(), .to_empty(...), or an assignment to "
                "param.data), so a step would train a detached copy and the module would "
                "never see it. Call fg.params(model) again after moving or converting "
                "the model, and build the state for it (tx.init or fg.load_state_dict)."
            )


def _view(buffer: Tensor, offset: int, shape: tuple[int, ...]) -> Tensor:
    """One entry of ``buffer``; along its last dimension, so that buffers stacked with
    a leading dimension (per-sample gradients, an ensemble's params) keep working."""
    if buffer.dim() == 1:
        return buffer.narrow(0, offset, math.prod(shape)).view(shape)
    lead = tuple(buffer.shape[:-1])
    return buffer.narrow(-1, offset, math.prod(shape)).view(*lead, *shape)


def pack(tree: Mapping[str, Tensor], layout: Layout) -> Any:  # a Flat
    """``tree`` (any mapping with ``layout``'s names) in ``layout``: ``tree`` itself if
    it already is; otherwise one ``cat`` per buffer, each entry keeping its dtype
    where the buffer's entries share one (a float32 update of a bfloat16 parameter
    stays float32)."""
    if isinstance(tree, Flat) and tree.layout is layout:
        return tree
    bufs = []
    for b in range(len(layout.sizes)):
        bufs.append(cat([tree[n].reshape(-1) for n in layout.names_in(b)]))
    return Flat(bufs, layout)


def cat(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)`` of 1-D tensors (``parts[0]`` alone if it is the only one).

    In the eager donated step (:func:`funcgrad.core._scratch.lending`) a large CPU result is
    written into a buffer kept from the previous step: a fresh one is a fresh ``mmap``
    whose pages all fault on first write (funcgrad/core/_scratch.py)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    scratch = borrowing(first)
    n = sum(p.shape[-1] for p in parts)
    if scratch is None or n < BIG or any(p.dtype != first.dtype or p.dim() != 1 for p in parts):
        return torch.cat(parts, dim=-1)
    return torch.cat(parts, out=scratch.empty((n,), first.dtype, first.device))


def like(tree: Mapping[str, Tensor], layout: Layout | None) -> Any:  # Flat or tree's type
    """``tree`` packed into ``layout``, or ``tree`` unchanged when ``layout`` is None."""
    return tree if layout is None else pack(tree, layout)


def layout_of(*trees: object) -> Layout | None:
    """The layout of the first :class:`Flat` among ``trees``, else None."""
    for t in trees:
        if isinstance(t, Flat):
            return t.layout
    return None


def by_buffer(tree: Any) -> dict[str, Tensor]:  # a Flat
    """The buffers keyed ``"0"``, ``"1"``...: per-name code run on whole buffers."""
    return {str(i): b for i, b in enumerate(tree.buffers)}


def from_buffers(out: Mapping[str, Tensor], layout: Layout) -> Any:  # a Flat
    """The inverse of :func:`by_buffer`."""
    return Flat([out[str(i)] for i in range(len(layout.sizes))], layout)


def zeros_like(params: Mapping[str, Tensor]) -> Any:  # Flat or dict
    """Zeros shaped like ``params``, in its layout (flat for a :class:`Flat`)."""
    if isinstance(params, Flat):
        return Flat([torch.zeros_like(b) for b in params.buffers], params.layout)
    return {k: torch.zeros_like(p) for k, p in params.items()}


def leaves(tree: Mapping[str, Tensor]) -> list[Tensor]:
    """The tensors that hold ``tree``'s data: a Flat's buffers, else its values."""
    return list(tree.buffers) if isinstance(tree, Flat) else list(tree.values())


# -- pytree registrations ---------------------------------------------------------


def _flatten_buffers(f: Flat) -> tuple[list[Tensor], Layout]:
    return list(f.buffers), f.layout


def _unflatten_buffers(children: Sequence[Any], layout: Layout) -> Flat:
    return Flat(tuple(children), layout)


_compat.register_pytree_node(
    Flat,
    _flatten_buffers,  # type: ignore[arg-type]
    _unflatten_buffers,  # type: ignore[arg-type]
    serialized_type_name="funcgrad.Flat",
)
optree.register_pytree_node(
    Flat,
    _flatten_buffers,  # type: ignore[arg-type]
    lambda layout, children: _unflatten_buffers(children, layout),  # type: ignore[arg-type]
    namespace=BUFFERS,
)


def _flatten_names(f: Flat) -> tuple[list[Tensor], Layout, tuple[str, ...]]:
    return list(f.views().values()), f.layout, f.layout.names


def _unflatten_names(layout: Layout, children: Sequence[Any]) -> Any:
    named = dict(zip(layout.names, children, strict=True))
    if children and all(_fits(c, e[2]) for c, e in zip(children, layout.entries, strict=True)):
        return pack(named, layout)
    # non-tensor leaves (masks, labels), tensors of other shapes (a sharded state's
    # whole shapes in a checkpoint) or DTensors: a plain dict of them
    return named


def _fits(child: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``child`` can be an entry of ``shape`` in a buffer: a tensor of it, not
    a ``DTensor`` (which has ``placements``; a checkpoint view's rows of a whole)."""
    return (
        isinstance(child, Tensor)
        and tuple(child.shape) == shape
        and not hasattr(child, "placements")
    )


for _namespace in (NAMESPACE, _compat.optree_global_namespace()):
    # also in optree's global namespace (_compat: without it a user's optree.tree_map
    # sees a Flat as one leaf), as a user reads it: by name
    if _namespace is not None:
        optree.register_pytree_node(
            Flat,
            _flatten_names,  # type: ignore[arg-type]
            _unflatten_names,  # type: ignore[arg-type]
            path_entry_type=optree.MappingEntry,
            namespace=_namespace,
        )


# -- from a module --------------------------------------------------------------


def _flattenable(p: Tensor) -> bool:
    """A parameter that can become a view of a flat buffer without changing its meaning
    or speed: a plain dense contiguous tensor (not channels_last, not a DTensor or
    other subclass, not sparse)."""
    return type(p) in (nn.Parameter, Tensor) and p.layout == torch.strided and p.is_contiguous()


def flatten_module(
    model: nn.Module, named: dict[str, nn.Parameter], data: dict[str, Tensor]
) -> Flat | None:
    """Move ``named`` (the trainable parameters of ``model``; ``data``: the same,
    detached) into flat buffers, the parameters becoming views of them; None where
    the flat layout cannot hold (a parameter that is not a plain contiguous dense
    tensor: see :func:`_flattenable`), and the caller keeps one tensor per parameter."""
    if not named or not all(_flattenable(p) for p in named.values()):
        return None
    flat = _BUILT.get(model)
    if flat is not None and (list(flat) != list(named) or not flat.attached()):
        flat = None
    if flat is None:
        layout = Layout.for_tensors(data)
        with torch.no_grad():  # new buffers (cat copies, also of a single tensor)
            flat = Flat(
                [
                    torch.cat([data[n].reshape(-1) for n in layout.names_in(b)])
                    for b in range(len(layout.sizes))
                ],
                layout,
            )
            for k, view in flat.views().items():
                named[k].data = view
    views = flat.views()
    flat._owner = (
        weakref.ref(model),
        tuple((k, weakref.ref(p)) for k, p in named.items()),
        tuple(views[k].data_ptr() for k in named),
    )
    _BUILT[model] = flat
    return Flat(flat.buffers, flat.layout, owner=flat._owner)


_BUILT: weakref.WeakKeyDictionary[nn.Module, Flat] = weakref.WeakKeyDictionary()
"""The last flat params built for each module: a second ``fg.params(model)`` returns
its buffers while the module's parameters are still their views."""
