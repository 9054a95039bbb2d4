"""The one optimizer kernel: every optimizer's step written once, per tensor.

An optimizer here is a :class:`Spec`: its state type (a NamedTuple ``count`` first,
then one dict per kind of slot, e.g. ``momentum_buffer``, and its ``hyperparams``),
how each slot starts, its hyperparameters as built, the step's scalars (learning
rate, bias corrections) as float64 0-d tensors computed from the state's
hyperparameters (funcgrad/optim/_hparams.py), and a
*kernel*: the update of one tensor from its gradient, parameter and slots, computed
through the operations :class:`Ops` gives it. :func:`build` turns it into a
``GradientTransformation`` that

- checks the state against the gradients (another optimizer's or model's state is
  a clear error, not a wrong step);
- runs the kernel over whole flat buffers when the optimizer is elementwise and the
  parameters come from ``fg.params(model)`` (one tensor per dtype, so the eager step
  makes a handful of kernel calls and the compiled step a handful of loops), else
  over per-name tensors (views of the buffers for ``fg.Flat``);
- computes float16/bfloat16 in float32 and stores the slots in their own dtype
  (torch's opmath), the update left in float32 for ``apply_updates`` to round once.

One kernel, three ways to run it, the same operations in the same order, so the same
values bit for bit (``tests/test_one_kernel.py``):

- traced by ``torch.compile``, under ``torch.func`` transforms and under
  differentiating autograd: tensor by tensor, out of place (:data:`PLAIN`; no fast
  path to refuse: see funcgrad/core/_compose.py);
- eagerly, an elementwise kernel over lists of tensors, one ``torch._foreach_*`` call
  per operation for each dtype (:class:`Lists`): fewer Python dispatches over many
  small tensors;
- inside the eager donated step, large CPU tensors one by one, each large result
  written into a buffer kept from the previous step (``out=``) instead of a fresh
  allocation, whose pages would all fault on first write (funcgrad/core/_scratch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._compat import compiling
from ..core import _flat as flat
from ..core._base import (
    GradientTransformation,
    Params,
    check_floating,
    check_state,
    params_device,
    shardable,
    with_facts,
)
from ..core._compose import composing
from ..core._fusion import realize
from ..core._scratch import BIG, borrowing
from ._hparams import (
    DecayMask,
    OptimizerInfo,
    compute_dtype,
    mask_resolver,
    next_value,
    scalar_fields,
    slot_fields,
    start_value,
    value64,
)
from ._ops import LISTS, PLAIN, Ops

Scalars = dict[str, Tensor]
"""The step's scalars by name, 0-d tensors (float64 from :attr:`Spec.scalars`, cast
to each compute dtype once before the kernel sees them)."""


class Entry(NamedTuple):
    """What a kernel sees of one tensor: its ``name`` (``"0"``, ``"1"``... for a whole
    flat buffer), gradient ``g``, parameter ``p`` (None when not passed) and ``slots``
    in the compute dtype, the step's scalars ``s`` in that dtype, whether weight
    decay applies (``decays``), the dtype the parameter is ``stored`` in, and the
    operations ``o`` to compute with (:class:`Ops`)."""

    name: str
    g: Tensor
    p: Tensor | None
    slots: dict[str, Tensor]
    s: Scalars
    decays: bool
    stored: torch.dtype
    o: Ops = PLAIN


Kernel = Callable[[Entry], tuple[Tensor, dict[str, Tensor]]]
"""One tensor's update and new slots (only the slots it changes), in the compute dtype."""


class Spec(NamedTuple):
    """One optimizer, for :func:`build` (see the module docstring).

    ``slots``: the state fields in use, each with how it starts from a tensor (a
    whole buffer or one parameter); ``None`` means the tensor has no such slot
    (Adafactor: row factors only for matrices). Fields of ``state`` not in ``slots``
    stay empty dicts. ``hyper``: the hyperparameters the state holds, as built
    (``_hparams.hyper``; ``None`` where a term is off). ``scalars(count, hp)``: the
    step's float64 scalars, ``count`` the new step count (1 on the first step), ``hp``
    the state's hyperparameters as float64 0-d tensors. ``needs_params``: the kernel reads the
    parameters (weight decay, Adafactor's scale). ``elementwise``: each output entry
    depends only on the same entry of the inputs, so the kernel may run on whole
    flat buffers. ``has_decay``: the optimizer has weight decay, applied where
    ``mask`` says (the kernel's ``decays`` flag; always False without it).
    ``multi_tensor`` (elementwise kernels only): the kernel computes on ``e.g``,
    ``e.p`` and ``e.slots`` only through ``e.o`` (and on the scalars as it likes), so
    it may run eagerly over lists of tensors (:class:`Lists`). Off where its
    ``e.o`` calls would take a tensor hyperparameter of its own that the
    ``_foreach_*`` overloads do not (Adam keeps such hyperparameters in its closure).
    ``carry``: the state's 0-d fields (``_hparams.scalar_fields``), each with its
    starting value from ``(count, hp)`` (``hp`` as ``scalars`` gets it). ``scalars``
    then finds each one's current value in ``hp`` under the field's name, and returns
    its next value under that name among the scalars (NAdam's ``mu_product``).
    """

    who: str
    state: Any  # a NamedTuple class: count, then the slot fields
    slots: Mapping[str, Callable[[Tensor], Tensor | None]]
    scalars: Callable[[Tensor, dict[str, Any]], dict[str, Tensor]]
    kernel: Kernel
    hyper: Mapping[str, Any]
    needs_params: bool
    elementwise: bool
    has_decay: bool = False
    mask: DecayMask = None
    multi_tensor: bool = True
    carry: Mapping[str, Callable[[Tensor, dict[str, Any]], Tensor]] = {}


def build(spec: Spec) -> GradientTransformation:
    """The transformation of ``spec`` (see the module docstring)."""
    spec = spec._replace(hyper=in_state(spec.hyper))
    who, fields = spec.who, slot_fields(spec.state)
    if set(spec.carry) != set(scalar_fields(spec.state)):
        raise TypeError(f"{who}: carry {sorted(spec.carry)} is not the state's 0-d fields.")
    decays = mask_resolver(spec.mask, who)

    def start(count: Tensor) -> dict[str, Any]:
        return {k: start_value(v, count) for k, v in spec.hyper.items()}

    def make(
        count: Tensor, slots: Mapping[str, Any], carried: Mapping[str, Tensor], hp: Any
    ) -> Any:
        return spec.state(count, **{f: slots.get(f, {}) for f in fields}, **carried, hyperparams=hp)

    def init(params: Params) -> Any:
        check_floating(params, f"{who}.init")
        decays(params)  # a mask for other parameters fails here, not at the first step
        count = torch.zeros((), dtype=torch.int64, device=params_device(params))
        hp = start(count)
        hp64 = {k: value64(v, count) for k, v in hp.items()}
        carried = {f: fn(count, hp64) for f, fn in spec.carry.items()}
        return make(count, {f: _start(spec, f, params) for f in fields}, carried, hp)

    def update(grads: Params, state: Any, params: Params | None = None) -> tuple[Params, Any]:
        check_state(state, spec.state, who)
        _check_names(spec, state, grads)
        if spec.needs_params and params is None:
            raise ValueError(
                f"{who} needs the parameters (for its weight decay or scale): call "
                "tx.update(grads, state, params)."
            )
        decay = decays(params) if spec.has_decay and params is not None else {}
        count = state.count + 1
        hp = state.hyperparams if state.hyperparams is not None else start(state.count)
        _check_hyper(spec, hp)
        hp64 = {k: value64(v, count) for k, v in hp.items()}
        s64 = spec.scalars(count, {**hp64, **{f: getattr(state, f) for f in spec.carry}})
        carried = {f: s64.pop(f) for f in spec.carry}
        slots = {f: getattr(state, f) for f in spec.slots}
        layout = flat.layout_of(grads, params, *slots.values())
        per_buffer = (
            decay_per_buffer(decay, layout) if spec.elementwise and layout is not None else None
        )
        if layout is not None and per_buffer is not None:
            grads = flat.pack(grads, layout)
            if params is not None:
                params = flat.pack(params, layout)
            out, new = _run(
                spec,
                flat.by_buffer(grads),
                None if params is None else flat.by_buffer(params),
                {f: flat.by_buffer(flat.pack(t, layout)) for f, t in slots.items()},
                per_buffer,
                s64,
            )
            updates = flat.from_buffers(out, layout)
            moved = {f: _as_given(flat.from_buffers(t, layout), slots[f]) for f, t in new.items()}
        else:
            out, new = _run(
                spec,
                _views(grads),
                None if params is None else _views(params),
                {f: _views(t) for f, t in slots.items()},
                decay,
                s64,
            )
            updates = out
            moved = {  # each slot stays in its layout (flat, or per name)
                f: flat.like(t, flat.layout_of(slots[f]) if spec.elementwise else None)
                for f, t in new.items()
            }
        after = {k: next_value(spec.hyper[k], v, count) for k, v in hp.items()}
        return updates, make(count, moved, carried, after)

    # by_entry: a mask given as a predicate decides from shapes, which a flat chunk's
    # pieces do not keep (fg.sharded then splits by rows)
    tx = shardable(
        GradientTransformation(init, update),
        by_entry=spec.elementwise and not callable(spec.mask),
    )
    return with_facts(tx, optimizer=OptimizerInfo(who, spec.state, dict(spec.hyper)))


def in_state(hyper: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters a state holds: those not built off (``None``, or a pair
    holding ``None``: Adafactor's machine epsilon)."""
    return {
        k: v for k, v in hyper.items()
        if v is not None and not (isinstance(v, tuple) and None in v)
    }  # fmt: skip


def _check_hyper(spec: Spec, hp: Mapping[str, Any]) -> None:
    """The state's hyperparameters are this optimizer's (a term built off is in
    neither)."""
    if hp.keys() != spec.hyper.keys():
        raise KeyError(
            f"{spec.who}.update: the state's hyperparameters {sorted(hp)} do not fit this "
            f"{spec.who}'s {sorted(spec.hyper)}. Was the state built by another "
            "transformation, or with other options (a term built off, such as "
            "weight_decay=0.0, is not in the state)?"
        )


def elementwise(
    who: str,
    state: Any,
    slots: Mapping[str, Callable[[Tensor], Tensor | None]],
    scalars: Callable[[Tensor, dict[str, Any]], dict[str, Tensor]],
    kernel: Kernel,
    hyper: Mapping[str, Any],
    has_decay: bool,
    mask: DecayMask,
    multi_tensor: bool = True,
    carry: Mapping[str, Callable[[Tensor, dict[str, Any]], Tensor]] | None = None,
    reads_params: bool = False,
) -> GradientTransformation:
    """The transformation of an elementwise optimizer (SGD, RMSprop, Adagrad, Lion,
    Adam): a :class:`Spec` whose kernel reads the parameters for weight decay, or
    always with ``reads_params`` (ASGD's average)."""
    spec = Spec(
        who, state, slots, scalars, kernel, hyper, needs_params=has_decay or reads_params,
        elementwise=True, has_decay=has_decay, mask=mask, multi_tensor=multi_tensor,
        carry=carry or {},
    )  # fmt: skip
    return build(spec)


def _as_given(t: flat.Flat, given: Mapping[str, Tensor]) -> Any:
    """A slot computed on flat buffers, in the form the state gave it: flat, or a dict
    per name (a state made per name, e.g. by ``fg.state_from_torch``, keeps its form
    under ``fg.params``' flat gradients, so a donated step can write it back)."""
    return t if isinstance(given, flat.Flat) else dict(t.views())


def _start(spec: Spec, field: str, params: Params) -> Any:
    """The field's starting dict (flat for an elementwise optimizer on ``fg.Flat``)."""
    start = spec.slots.get(field)
    if start is None:
        return {}
    if spec.elementwise and isinstance(params, flat.Flat):
        return flat.Flat([_started(start, b) for b in params.buffers], params.layout)
    out = {}
    for k, p in params.items():  # a loop, not a comprehension with :=, which dynamo
        t = start(p.detach())  # cannot trace (an optimizer built inside torch.compile)
        if t is not None:
            out[k] = t
    return out


def _started(start: Callable[[Tensor], Tensor | None], t: Tensor) -> Tensor:
    out = start(t.detach())
    assert out is not None  # elementwise slots exist for every tensor
    return out


def _views(tree: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return tree.views() if isinstance(tree, flat.Flat) else dict(tree)


def _check_names(spec: Spec, state: Any, grads: Params) -> None:
    """The state's slots cover exactly the gradients' names, with the options in use."""
    fields = slot_fields(spec.state)
    on = [f for f in fields if f in spec.slots]
    stray = [f for f in fields if f not in spec.slots and getattr(state, f)]
    named: set[str] = set()
    for f in on:
        named |= set(getattr(state, f))
    ok = not stray and (not on or named == set(grads))
    if spec.elementwise:
        ok = ok and all(getattr(state, f).keys() == grads.keys() for f in on)
    if not ok:
        have = sorted(named) if named else "no slots"
        raise KeyError(
            f"{spec.who}.update: the state does not fit these gradients: it holds "
            f"{[f for f in fields if getattr(state, f)] or 'no slots'} for {have}, while "
            f"this {spec.who} keeps {on or 'no slots'} for {sorted(grads)}. Was the state "
            "built by another transformation, with other options, or for another model?"
        )


def decay_per_buffer(decay: Mapping[str, bool], layout: flat.Layout) -> dict[str, bool] | None:
    """Weight decay per buffer (keyed as :func:`funcgrad.core._flat.by_buffer`), or None
    where a mask decays some of a buffer's tensors and not others."""
    out: dict[str, bool] = {}
    for b in range(len(layout.sizes)):
        flags = {decay.get(n, False) for n in layout.names_in(b)}
        if len(flags) > 1:
            return None
        out[str(b)] = flags.pop()
    return out


def _realized(scalars: Scalars) -> Scalars:
    """Traced, the 0-d scalars computed once into one buffer (``realize``), not again
    for every vector of every update loop, where the C++ compiler cannot hoist them
    (Adagrad's decayed learning rate is a float64 division); the same values."""
    if not scalars or not compiling():
        return scalars
    if any(v.dim() != 0 for v in scalars.values()):
        return scalars
    return dict(zip(scalars, realize(torch.stack(list(scalars.values()))).unbind(0), strict=True))


def _run(
    spec: Spec,
    grads: Mapping[str, Tensor],
    params: Mapping[str, Tensor] | None,
    slots: dict[str, Mapping[str, Tensor]],
    decay: Mapping[str, bool],
    s64: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """The kernel on each tensor, in its compute dtype; slots stored back in theirs.

    Traced, transformed or recorded by autograd: tensor by tensor with :data:`PLAIN`
    operations. Eagerly: an elementwise ``multi_tensor`` kernel runs once per
    (dtype, weight decay) group over lists (:class:`Lists`), except for the large
    CPU tensors of a donated step, which go tensor by tensor into borrowed buffers."""
    per_dtype: dict[torch.dtype, Scalars] = {}
    first = next(iter(grads.values()), None)
    # (meta tensors: make_step's shape checks, where _foreach_* with a 0-d tensor reads it)
    plain = (
        first is None
        or first.device.type == "meta"
        or composing(grads, params, *slots.values(), *s64.values())
    )
    scratch = None if plain or first is None else borrowing(first)
    lists = spec.multi_tensor and spec.elementwise and not plain
    ops = PLAIN if scratch is None else Ops(scratch)
    cast_params = params is not None and spec.needs_params

    def scalars(dt: torch.dtype) -> Scalars:
        if dt not in per_dtype:
            per_dtype[dt] = _realized({n: _to(v, dt) for n, v in s64.items()})
        return per_dtype[dt]

    updates: dict[str, Tensor] = {}
    new: dict[str, dict[str, Tensor]] = {f: {} for f in slots}
    groups: dict[tuple[torch.dtype, bool], list[str]] = {}
    for k, g in grads.items():
        sdt = params[k].dtype if params is not None else g.dtype
        if lists and (scratch is None or g.numel() < BIG):
            groups.setdefault((sdt, decay.get(k, False)), []).append(k)
            continue
        mine = {f: t[k] for f, t in slots.items() if k in t}
        dt = compute_dtype(sdt)
        p = params[k].to(dt) if cast_params and params is not None else None
        slots_dt = {f: _to(t, dt) for f, t in mine.items()}
        entry = Entry(k, _to(g, dt), p, slots_dt, scalars(dt), decay.get(k, False), sdt, ops)
        u, out = spec.kernel(entry)
        updates[k] = u
        for f, t in out.items():
            new[f][k] = _to(t, mine[f].dtype)
    for (sdt, decays), keys in groups.items():
        dt = compute_dtype(sdt)
        # Lists stand in for the tensors: Lists takes the kernel's operations over them.
        g_list: Any = [_to(grads[k], dt) for k in keys]
        p_list: Any = None
        if cast_params and params is not None:
            p_list = [params[k].to(dt) for k in keys]
        slot_lists: Any = {f: [_to(t[k], dt) for k in keys] for f, t in slots.items()}
        entry = Entry("", g_list, p_list, slot_lists, scalars(dt), decays, sdt, LISTS)
        u, out = spec.kernel(entry)
        updates.update(zip(keys, u, strict=True))  # type: ignore[call-overload]
        for f, ts in out.items():
            for k, t in zip(keys, ts, strict=True):  # type: ignore[call-overload]
                new[f][k] = _to(t, slots[f][k].dtype)
    if groups:  # back in the gradients' order
        updates = {k: updates[k] for k in grads}
        new = {f: {k: t[k] for k in grads if k in t} for f, t in new.items()}
    return updates, new


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, without the call when it would return ``t`` (eager overhead)."""
    return t if t.dtype == dtype else t.to(dtype)
