"""Moving between an ``nn.Module`` and flat dicts of tensors.

funcgrad never reads ``.grad`` or mutates a module during a step: a module is only a
function ``(params, buffers, inputs) -> outputs`` through ``functional_call``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._compat import compiling
from ..core._base import Params, check_floating
from ..core._flat import flatten_module
from ..core._tree import sigint_held
from ._errors import BUFFER_WRITE, explain_buffer_write, reraise


def params(model: nn.Module) -> Params:
    """Trainable parameters of ``model`` as a mapping name -> tensor, detached,
    sharing storage with the module.

    Keys are exactly those of ``model.named_parameters()``; parameters with
    ``requires_grad=False`` are left out (they stay frozen), and a parameter shared by
    two modules (tied weights) appears once, under its first name.

    The parameters move into one flat buffer per (device, dtype) (a
    :class:`funcgrad.Flat`; on the CPU, buffers of at most 16 MiB: a step's flat
    temporaries stay off fresh ``mmap`` pages; the module's parameters become views of it, so
    ``model.load_state_dict(...)`` still writes what the next step trains), and
    optimizer states built from it are flat too: a compiled step then has a few
    buffers to update instead of one tensor per parameter (docs/flat-layout.md).
    A parameter that cannot be a view (channels_last, a tensor subclass such as a
    DTensor, sparse) keeps the whole model in the per-tensor layout, a plain dict.
    Calling it again returns the same buffers. The first call moves the parameters:
    tensors taken from the module before it (``p.detach()``, ``p.data``) are no
    longer the module's (``nn.Parameter`` objects, and optimizers holding them, are
    unaffected). After re-allocating the module's
    parameters (``model.to(dtype)``, ``model.half()``, ``to_empty``), call it again:
    a step given the old params raises an error instead of training a copy.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> p = fg.params(model)
        >>> sorted(p), p["weight"].data_ptr() == model.weight.data_ptr()
        (['bias', 'weight'], True)
    """
    if compiling():
        raise RuntimeError(
            "fg.params(model) was called inside a torch.compile'd function. It moves the "
            "module's parameters into flat buffers (a one-time change of the module, "
            "which a traced graph cannot make); call it once outside and pass the result "
            "in: params = fg.params(model); compiled(params, ...)."
        )
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    out = {name: p.detach() for name, p in named.items()}
    check_floating(out, "fg.params")
    flat = flatten_module(model, named, out)
    return out if flat is None else flat  # type: ignore[return-value]


def buffers(model: nn.Module) -> dict[str, Tensor]:
    """Buffers of ``model`` (e.g. BatchNorm running statistics) as a flat dict.

    The tensors are the module's own, so in-place updates made during a
    train-mode forward pass through :func:`call` are seen by the module.

    Examples:
        >>> import torch, funcgrad as fg
        >>> sorted(fg.buffers(torch.nn.BatchNorm1d(3)))
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    return dict(model.named_buffers())


def _walk(model: nn.Module) -> tuple[set[str], set[str], list[Tensor]]:
    """In one pass over the modules: every parameter name (tied aliases included), the
    trainable names as ``named_parameters()`` gives them (a tied parameter under its
    first name), and the buffers (each once; none while traced, where ``id()`` of a
    buffer would guard the graph on the very tensor objects given, and a step that
    returns new buffers would recompile)."""
    traced = compiling()
    every: set[str] = set()
    trainable: set[str] = set()
    seen: set[int] = set()
    bufs: dict[int, Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for n, p in module._parameters.items():
            if p is None:
                continue
            every.add(dot + n)
            if id(p) not in seen:
                seen.add(id(p))
                if p.requires_grad:
                    trainable.add(dot + n)
        for b in () if traced else module._buffers.values():
            if b is not None:
                bufs.setdefault(id(b), b)
    return every, trainable, list(bufs.values())


def _close(name: str, known: set[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{near[0]}'?)" if near else ""


def _reject_unknown(
    model: nn.Module, given: Mapping[str, Any], known: set[str], what: str, kind: str, fix: str
) -> None:
    unknown = [n for n in given if n not in known]
    if unknown:
        n = unknown[0]
        raise KeyError(
            f"{what}: '{n}' is not a {kind} of {type(model).__name__}{_close(n, known)}. "
            f"Unknown {kind} names: {sorted(unknown)}. {fix}"
        )


def check_names(model: nn.Module, given: Mapping[str, Any], what: str) -> list[Tensor]:
    """Unknown names and missing trainable names are errors, never silently ignored.
    Returns the model's buffers (found in the same pass)."""
    every, trainable, bufs = _walk(model)
    _reject_unknown(model, given, every, what, "parameter", "Use the keys of fg.params(model).")
    missing = sorted(trainable.difference(given))  # not `- keys()`: dynamo 2.11 refused it
    if missing:
        raise KeyError(
            f"{what}: trainable parameters {missing} are missing. Pass every entry of "
            "fg.params(model); to freeze a parameter, call p.requires_grad_(False) on it "
            "before taking fg.params(model)."
        )
    return bufs


def check_buffer_names(model: nn.Module, given: Mapping[str, Any], what: str) -> None:
    """Buffers passed explicitly must be exactly the model's (as ``fg.buffers(model)``)."""
    known = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    _reject_unknown(model, given, known, what, "buffer", "Pass fg.buffers(model).")
    missing = sorted({n for n, _ in model.named_buffers()}.difference(given))
    if missing:
        raise KeyError(
            f"{what}: buffers {missing} are missing. Pass every entry of fg.buffers(model), "
            "or no buffers at all to use the module's own."
        )


def load_params(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copy ``params`` into ``model``'s parameters, in place.

    Names must match ``fg.params(model)`` exactly, and each tensor must have the
    parameter's shape and dtype (it may live on another device).

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> fg.load_params(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
        >>> model.weight
        Parameter containing:
        tensor([[1., 1.]], requires_grad=True)
    """
    check_names(model, params, "fg.load_params")
    targets = dict(model.named_parameters(remove_duplicate=False))
    for name, value in params.items():
        target = targets[name]
        if not isinstance(value, Tensor):
            raise TypeError(f"fg.load_params: '{name}' is a {type(value).__name__}, not a Tensor.")
        if value.shape != target.shape:
            raise ValueError(
                f"fg.load_params: shape mismatch for '{name}': the model has "
                f"{tuple(target.shape)}, the given tensor has {tuple(value.shape)}. "
                "Were these params saved from a different architecture?"
            )
        if value.dtype != target.dtype:
            raise TypeError(
                f"fg.load_params: dtype mismatch for '{name}': the model has "
                f"{target.dtype}, the given tensor has {value.dtype}. Convert one side "
                f"first, e.g. model.to({value.dtype}) or "
                f"{{k: v.to({target.dtype}) for k, v in params.items()}}."
            )
    with torch.no_grad():
        for name, value in params.items():
            target = targets[name]
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)


_WATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("funcgrad_watch", default=False)


@contextlib.contextmanager
def watching_buffers() -> Iterator[None]:
    """While on (a training step's forward and backward), :func:`call` without
    ``buffers=`` raises if the forward wrote any of the module's buffers.

    ``torch.func.grad`` refuses such a write (train-mode BatchNorm updating its
    running statistics) when the written value depends on the parameters; plain
    autograd would let it through and the module's statistics would change silently.
    The version counters make one rule for both: a step writes buffers only when
    they travel through it (``make_step(buffers=True)``).
    """
    token = _WATCH.set(True)
    try:
        yield
    finally:
        _WATCH.reset(token)


def call(
    model: nn.Module,
    params: Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``model(*args, **kwargs)`` with ``params`` (and ``buffers``) substituted.

    A thin, checked wrapper of ``torch.func.functional_call``: gradients taken with
    ``torch.func.grad`` over ``params`` equal those of ``loss.backward()``. Buffers
    default to the module's own. Tied parameters follow the one name given.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> p = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> fg.call(model, p, torch.tensor([[1.0, 2.0]]))
        tensor([[3.]])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fg.call: expected an nn.Module as first argument, got {type(model).__name__}. "
            "Call it as fg.call(model, params, *inputs)."
        )
    # Plain Python over names: eagerly it runs every call, under torch.compile once,
    # while the step is traced (a failure there is re-run eagerly by make_step).
    bufs = check_names(model, params, "fg.call")
    if compiling():  # traced: no module attribute is swapped at run time
        return _call(model, params, args, kwargs, buffers)
    # functional_call swaps the module's attributes for the given tensors while the
    # forward runs, so two threads in the same module at once would each run with
    # the other's tensors (and leave plain tensors behind): forwards through one
    # module take turns. The backward, where most of a step's time goes, does not
    # touch the module and runs concurrently. A Ctrl-C (KeyboardInterrupt) landing
    # while functional_call swaps the tensors in or back would leave the module holding
    # the given tensors instead of its parameters (42 of 300 random Ctrl-C's did, on a
    # 20-layer MLP): it is held back until the forward is done, then delivered.
    watch = _WATCH.get() and buffers is None
    # A shadow is this call's own (made below): no other thread swaps in it, no lock.
    shadow = _SHADOW.get()
    turns: Any = contextlib.nullcontext() if shadow else lock_of(model)
    if shadow:
        model = _shadow(model, {})
    with turns, sigint_held():
        before = [b._version for b in bufs] if watch else None
        out = _call(model, params, args, kwargs, buffers)
        if before is not None and [b._version for b in bufs] != before:
            raise RuntimeError(f"fg.call: {BUFFER_WRITE}")
        return out


_SHADOW: contextvars.ContextVar[bool] = contextvars.ContextVar("funcgrad_shadow", default=False)


@contextlib.contextmanager
def shadowing() -> Iterator[None]:
    """While on (in this thread), :func:`call` runs each forward on a shadow of the
    module: new module objects whose parameter, buffer and child dicts are copies,
    holding the module's own tensors. ``functional_call`` then swaps tensors in the
    shadow's dicts, never in the module's.

    ``make_step(compile="async")`` steps eagerly under it while another thread traces
    the step: dynamo reads the real module's attributes as it traces (and again when
    it restarts its analysis), and a forward swapping them meanwhile made it trace
    another module (a tied weight seen untied, "head.weight missing": char_gpt's
    build failed so). The shadow is made again on every call, so it follows
    ``model.train()``/``eval()`` and anything else set on the module between steps;
    its cost (one shallow copy per submodule per forward) is paid only while a build
    runs."""
    token = _SHADOW.set(True)
    try:
        yield
    finally:
        _SHADOW.reset(token)


def _shadow(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` and its submodules (a module reached twice is one
    shadow, so shared modules stay shared), with dicts of its own."""
    done = memo.get(id(module))
    if done is not None:
        return done
    clone = copy.copy(module)
    memo[id(module)] = clone
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {
        k: None if m is None else _shadow(m, memo) for k, m in module._modules.items()
    }
    return clone


_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def lock_of(model: nn.Module) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def _call(
    model: nn.Module,
    params: Mapping[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    buffers: Mapping[str, Tensor] | None,
) -> Any:
    tensors = dict(params)
    cumulative: list[nn.Module] = []
    if buffers is not None:
        check_buffer_names(model, buffers, "fg.call")
        tensors.update(buffers)
        cumulative = _cumulative_batchnorms(model)
    try:
        if not cumulative:
            return functional_call(model, tensors, args, kwargs, strict=False, tie_weights=True)
        return _call_with_cumulative_averages(model, tensors, args, kwargs, cumulative)
    except RuntimeError as err:
        reraise(err, explain_buffer_write(err))


_STATS = ("running_mean", "running_var")


def _cumulative_batchnorms(model: nn.Module) -> list[nn.Module]:
    """Train-mode BatchNorms with ``momentum=None`` (a cumulative moving average)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.momentum is None
        and m.training
        and m.track_running_stats
    ]


def _call_with_cumulative_averages(
    model: nn.Module,
    tensors: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cumulative: list[nn.Module],
) -> Any:
    """``functional_call`` for models with ``BatchNorm(momentum=None)`` layers.

    With ``momentum=None``, BatchNorm computes its averaging factor as
    ``1 / float(num_batches_tracked)``: a read of a tensor on the host, which
    torch.compile cannot trace into one graph ("Could not guard on data-dependent
    expression"). So these layers run with ``momentum=1.0`` (the running statistics
    become the batch's) and the cumulative average is then formed with tensor ops:
    ``old + (batch - old) / num_batches_tracked``, the same value as torch's
    ``(1 - 1/n) * old + batch / n`` up to rounding.
    """
    prefix = {id(m): (f"{n}." if n else "") for n, m in model.named_modules()}
    keys = [prefix[id(m)] + stat for m in cumulative for stat in _STATS]
    # BatchNorm writes its batch statistics into working copies; the given buffers
    # are written once, below. (native_batch_norm saves the running statistics it
    # was given for its backward, so those must not be written in place afterwards.)
    given = {k: tensors[k] for k in keys}
    tensors = {**tensors, **{k: t.clone() for k, t in given.items()}}
    for m in cumulative:
        m.momentum = 1.0  # type: ignore[assignment]
    try:
        out = functional_call(model, tensors, args, kwargs, strict=False, tie_weights=True)
    finally:
        for m in cumulative:
            m.momentum = None  # type: ignore[assignment]
    for m in cumulative:
        count = tensors[prefix[id(m)] + "num_batches_tracked"]
        for stat in _STATS:
            key = prefix[id(m)] + stat
            old = given[key]
            old.copy_(old + (tensors[key] - old) / count)
    return out
