"""Ghost clipping's global forward hooks: what one pass over the loss records.

A ghost step (``_ghost.py``) runs the loss in three kinds of pass, set per thread in
``_TAP.mode``:

- ``"probe"``: record the shapes the tap pass will add zeros to;
- ``"tap"``: add a zero tensor ``z`` to the output of every module that owns trained
  parameters (:class:`Call`), and to the floating positional inputs of every call made
  directly by such a module when it also has children (:class:`Child`: what its vmap
  fallback needs to rerun its own code alone); record inputs and outputs;
- ``"stub"``: the fallback's rerun of one module, sample by sample, in which each call
  it makes itself returns what that call returned in the tap pass (:func:`stubbed`).

The hooks are in torch's global tables only while a ghost step runs (:func:`hooked`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import _compat
from .._compat import tree_flatten, tree_unflatten
from ..model._errors import PER_SAMPLE_BATCHNORM
from ..model._model import lock_of
from ._ghost_adoption import Adoption

Shapes = list[list[tuple[tuple[int, ...], torch.dtype]]]
"""The tapped tensors' shapes and dtypes, one list per tapped call, in order."""

OUT, IN, IN_FIXED = "out", "in", "in-fixed"
"""A probed entry's kind: a module's outputs; the inputs of a call a module makes
itself, with the batch first (``IN``) or not (``IN_FIXED``: its module keeps the whole
vmap fallback)."""


def float_leaves(output: Any) -> tuple[list[Any], Any]:
    """A module's output as leaves (torch's pytree, which dynamo traces) and its spec."""
    return tree_flatten(output)


def _floating(leaves: Sequence[Any]) -> list[int]:
    return [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]


def broadcast_lead(shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether a shared call's outputs all lead with a dimension of 1 (a positional
    embedding on ``arange(T)[None]``: ``(1, T, d)``, added to the batch's ``(B, T, d)``).
    That dimension is where the batch broadcasts, so the batch goes there, ``(B, T, d)``,
    rather than in front of it (``(B, 1, T, d)``, which the addition would broadcast to
    ``(B, B, T, d)``); its output gradients get the 1 back (``(B, 1, T, d)``)."""
    return bool(shapes) and all(len(s) > 0 and s[0] == 1 for s in shapes)


def module_path(names: dict[str, str]) -> str:
    """The module's path in the model (``""`` for the root) from its trained parameters'
    own name -> full name; the first entry is one of its own (``_trained``)."""
    own, full = next(iter(names.items()))
    return full[: len(full) - len(own)].rstrip(".")


class Child:
    """A call made directly by a module that owns trained parameters and has children:
    its floating positional inputs' gradients and its output, so that the module's
    fallback reruns only its own code (``_ghost_layers.Vmapped``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.n_in = 0  # tapped floating positional inputs
        self.batched_in = True  # every tapped input has the batch first (the probe's)
        self.float_kwargs = False  # a floating tensor passed by keyword: not tapped
        self.in_grads: list[Tensor] = []
        self.output: Any = None  # what the call returned (our own hook's result)
        self.leaves: list[Any] = []
        self.spec: Any = None


class Call:
    """One call of a module that owns trained parameters, recorded by the tap pass."""

    def __init__(
        self, module: nn.Module, names: dict[str, str], args: Any, kwargs: Any, n_out: int
    ) -> None:
        self.module, self.names, self.args, self.kwargs, self.n_out = (
            module, names, args, kwargs, n_out,
        )  # fmt: skip
        self.grads: list[Tensor] = []  # the output leaves' gradients, filled after the pass
        # For a module without a rule of its own (Vmapped): the tensors its subtree ran
        # with (functional_call puts the module's own back after the pass), and the
        # calls it made itself (None: it has no children).
        self.state: dict[str, Tensor] = {}
        self.children: list[Child] | None = None
        self.root = module  # the module the loss called (fg.call's), this one within it
        self.shared = False  # called without the batch (a positional embedding on arange)
        self.lead: tuple[bool, ...] = ()  # per output: the same for every sample, led by
        # a 1 that takes the batch (a shared call's, or T5's position bias beside a batch)
        self.leaves: list[Any] = []  # (args, kwargs) flattened, while torch.func unwraps
        self.spec: Any = None


class _Frame:
    """A module call in progress (the pre-hook pushes it, the hook pops it)."""

    def __init__(self, module: nn.Module, names: dict[str, str], parent: bool) -> None:
        self.module, self.names = module, names
        self.children: list[Child] | None = [] if parent else None
        self.record: Child | None = None  # this call, as its parent's Child


class _Tap(threading.local):
    """The pass in progress in this thread (see the module docstring)."""

    def __init__(self) -> None:
        # Every field set on the instance in each thread (not class defaults): dynamo
        # guards on what the instance's __dict__ holds, which must not change in a step.
        self.mode: str | None = None
        self.named: Sequence[tuple[str, Tensor]] = ()
        self.shapes: Shapes | None = None
        self.kinds: list[str] = []  # the probe's entries' kinds (OUT, IN)
        self.owners: list[str] = []  # the probe's entries: each module's path
        self.callers: list[tuple[nn.Module, nn.Module | None]] = []  # the probe's OUT
        # entries: the module, and the module whose call made it (None: the loss)
        self.adoption = Adoption()
        self.reached: set[str] = set()  # the probe's: parameters reached by their calls
        self.zs: Sequence[Tensor] = ()
        self.used = 0
        self.calls: list[Call] | None = None
        self.entries: list[Call | Child] = []  # the tap pass's records, in call order
        self.at = 0  # the plan entry the tap pass is at
        self.plan: Sequence[tuple[bool, tuple[bool, ...], str]] = ()  # shared, lead, kind
        self.batch = 0
        self.stack: list[_Frame | None] = []
        self.stub: list[tuple[nn.Module, Child, list[Tensor]]] = []  # "stub": each call's
        self.captured: list[Tensor] = []  # "stub": the direct calls' floating inputs


_TAP = _Tap()


def _trained(module: nn.Module) -> dict[str, str]:
    """The module's trained parameters, own name -> name in the params: its own, and
    those of the modules it adopted (``child.weight``); none for an adopted module."""
    if id(module) in _TAP.adoption.given:
        return {}
    return _owned(module)


def _owned(module: nn.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for own, p in module._parameters.items():
        if p is None:
            continue
        for name, t in _TAP.named:
            if t is p:
                out[own] = name
                break
    for path, child in _TAP.adoption.adopted.get(id(module), ()):
        for own, name in _owned(child).items():
            out[f"{path}.{own}"] = name
    return out


def _caller() -> nn.Module | None:
    """The module whose call is in progress below the one ending (None: the loss)."""
    frame = _TAP.stack[-1] if _TAP.stack else None
    return None if frame is None else frame.module


def _pre_hook(module: nn.Module, args: Any) -> Any:
    mode = _TAP.mode
    if mode is None:
        return None
    stack = _TAP.stack
    if mode == "stub":  # the rerun module is at the bottom; its own calls above it
        stack.append(None)
        if len(stack) == 2:
            leaves, _ = tree_flatten(args)
            _TAP.captured += [leaves[i] for i in _floating(leaves)]
        return None
    parent = stack[-1] if stack else None
    names = _trained(module)
    parent_of = id(module) not in _TAP.adoption.adopted  # (an adopter reruns whole)
    frame = _Frame(
        module, names, parent_of and bool(names) and next(module.children(), None) is not None
    )
    stack.append(frame)
    if parent is None or parent.children is None:
        return None
    child = Child(module)
    parent.children.append(child)
    frame.record = child
    if mode == "tap":  # in the order its z's are taken (before its own calls')
        _TAP.entries.append(child)
    leaves, spec = tree_flatten(args)
    slots = _floating(leaves)
    child.n_in = len(slots)
    if not slots:
        return None
    if mode == "probe":
        assert _TAP.shapes is not None
        _TAP.shapes.append([(tuple(leaves[i].shape), leaves[i].dtype) for i in slots])
        _TAP.kinds.append(IN)
        _TAP.owners.append(module_path(parent.names))
        return None
    child.batched_in = _TAP.plan[_TAP.at][2] == IN
    _TAP.at += 1
    new = list(leaves)
    for i in slots:
        new[i] = leaves[i] + _TAP.zs[_TAP.used]
        _TAP.used += 1
    return tree_unflatten(new, spec)


def _hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    mode = _TAP.mode
    if mode is None:
        return None
    frame = _TAP.stack.pop() if _TAP.stack else None
    if mode == "stub":
        return _stub_output(module) if len(_TAP.stack) == 1 else None
    if frame is None or frame.module is not module:  # a call the pre-hook did not see
        if frame is not None:
            _TAP.stack.append(frame)
        frame = _Frame(module, _trained(module), False)
    if id(module) in _TAP.adoption.given:
        _TAP.adoption.check(module, _caller())
    child = frame.record
    if child is not None and mode == "tap":
        kw, _ = tree_flatten(kwargs)
        child.float_kwargs = bool(_floating(kw))
    result = _tapped_output(module, frame, kwargs, args, output) if frame.names else None
    if child is not None and mode == "tap":
        child.output = output if result is None else result
    return result


def _tapped_output(module: nn.Module, frame: _Frame, kwargs: Any, args: Any, output: Any) -> Any:
    """A module that owns trained parameters: its output's shapes (probe) or its output
    plus the ``z``'s, and its :class:`Call` (tap)."""
    names, mode = frame.names, _TAP.mode
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # batch statistics mix samples
        if module.training:
            raise RuntimeError(f"fg.ghost_clip: {PER_SAMPLE_BATCHNORM}")
        if module.running_mean is None:
            raise RuntimeError(
                f"fg.ghost_clip: {type(module).__name__} built with "
                "track_running_stats=False normalizes with the batch's statistics in eval "
                "mode too, so the samples mix and have no per-sample gradients. Use "
                "GroupNorm/LayerNorm, or a BatchNorm with running statistics in eval mode."
            )
    leaves, spec = float_leaves(output)
    slots = _floating(leaves)
    if mode == "probe":
        assert _TAP.shapes is not None
        index = len(_TAP.shapes)
        _TAP.shapes.append([(tuple(leaves[i].shape), leaves[i].dtype) for i in slots])
        _TAP.kinds.append(OUT)
        _TAP.owners.append(module_path(names))
        _TAP.callers.append((module, _caller()))
        _TAP.reached.update(names.values())
        if index >= len(_TAP.plan):
            return None
        shared, lead, _ = _TAP.plan[index]
        if not (shared or any(lead)):
            return None
        new = list(leaves)  # as the tap pass will: with the batch
        for i, le in zip(slots, lead, strict=True):
            if le or shared:
                shape = leaves[i].shape[1:] if le else leaves[i].shape
                new[i] = leaves[i].expand(_TAP.batch, *shape)
        return tree_unflatten(new, spec)
    assert _TAP.calls is not None
    shared, lead, _ = _TAP.plan[_TAP.at]
    _TAP.at += 1
    new = list(leaves)
    for i in slots:  # a call without the batch (shared by the samples) gets it here
        new[i] = leaves[i] + _TAP.zs[_TAP.used]
        _TAP.used += 1
    call = Call(module, names, args, kwargs, len(slots))
    call.shared, call.lead, call.children = shared, lead, frame.children
    call.root = next((f.module for f in _TAP.stack if f is not None), module)
    call.state = {  # a module in _RULES may still need it: see layer_of
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    _TAP.calls.append(call)
    _TAP.entries.append(call)
    return tree_unflatten(new, spec)


def _stub_output(module: nn.Module) -> Any:
    """In the rerun of one module: a call it makes itself returns the sample's part of
    what it returned in the tap pass (its own computation skipped or unused)."""
    if not _TAP.stub or _TAP.stub[0][0] is not module:
        raise RuntimeError(
            "fg.ghost_clip: a module's rerun for its per-sample gradients called "
            f"{type(module).__name__} where the tap pass called "
            f"{type(_TAP.stub[0][0]).__name__ if _TAP.stub else 'nothing'}: the "
            "module's forward must call the same modules in the same order every time."
        )
    _, child, outs = _TAP.stub.pop(0)
    it = iter(outs)
    leaves = [next(it) if isinstance(t, Tensor) else t for t in child.leaves]
    return tree_unflatten(leaves, child.spec)


def _skipping(real: Any) -> Any:
    """A forward that does nothing in this thread's rerun of its caller, where
    :func:`_stub_output` replaces its output, and is ``real`` everywhere else (other
    threads, a call at another depth)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if _TAP.mode == "stub" and len(_TAP.stack) == 2:
            return None
        return real(*args, **kwargs)

    return forward


class rerunning:
    """Eagerly, around one module's per-sample rerun: the lock under which ``fg.call``'s
    forwards through ``root`` take turns (the rerun swaps tensors in the module, as they
    do), and the forwards of the ``modules`` it calls skipped in this thread (an
    instance ``forward`` while it runs; one the user set is put back after)."""

    def __init__(self, root: nn.Module, modules: list[nn.Module]) -> None:
        self.root, self.modules = root, list({id(m): m for m in modules}.values())
        self.saved: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> None:
        self.lock = lock_of(self.root)
        self.lock.acquire()
        for m in self.modules:
            self.saved.append((m, m.__dict__.get("forward")))
            m.forward = _skipping(m.forward)  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        for m, own in reversed(self.saved):
            if own is None:
                del m.forward
            else:
                m.forward = own  # type: ignore[method-assign]
        self.saved = []
        self.lock.release()


class stubbed:
    """The rerun of one module for one sample (under ``vmap``): each call it makes
    itself returns ``outs`` (per :class:`Child`, its output's tensors, the sample's);
    ``captured`` gathers those calls' floating positional inputs. ``modules``: the
    module each call is made on in the rerun."""

    def __init__(
        self, modules: list[nn.Module], children: list[Child], outs: list[list[Tensor]]
    ) -> None:
        self.modules, self.children, self.outs = modules, children, outs

    def __enter__(self) -> list[Tensor]:
        if _TAP.mode is not None:
            raise RuntimeError("fg.ghost_clip: a module's rerun inside another pass")
        _TAP.mode, _TAP.stack, _TAP.captured = "stub", [], []
        _TAP.stub = list(zip(self.modules, self.children, self.outs, strict=True))
        return _TAP.captured

    def __exit__(self, *exc: object) -> None:
        left = len(_TAP.stub)  # (fresh lists: dynamo must not keep vmap's tensors alive)
        _TAP.mode, _TAP.stack, _TAP.stub, _TAP.captured = None, [], [], []
        if left and exc[0] is None:
            raise RuntimeError(
                f"fg.ghost_clip: a module's rerun for its per-sample gradients made {left} "
                "fewer calls than in the tap pass: its forward must call the same modules "
                "in the same order every time."
            )


class _Installed:
    """The global forward hooks, in torch's tables only while some thread runs a ghost
    step (a count of the steps in progress, under a lock), under the same keys every
    time (``_compat.GlobalForwardHook``: dynamo guards on the tables)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.hook: _compat.GlobalForwardHook | None = None

    def __enter__(self) -> None:
        with self.lock:
            if self.hook is None:
                self.hook = _compat.GlobalForwardHook(_hook, _pre_hook)
            if self.count == 0:
                self.hook.add()
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0 and self.hook is not None:
                self.hook.remove()


_INSTALLED = _Installed()


def hooked() -> _Installed:
    """The context in which ghost steps run: the tap's global forward hooks are in
    torch's tables from the first entry (in any thread) to the last exit. ``fg.make_step``
    enters it around each call of a ghost step and around its background build, where
    the compiled step is traced; a ghost gradient function called eagerly enters it
    itself."""
    return _INSTALLED


class Passing:
    """Set the thread's pass for the block; always reset after it."""

    def __init__(
        self,
        mode: str,
        named: Sequence[tuple[str, Tensor]],
        batch: int,
        adoption: Adoption | None = None,
    ) -> None:
        self.mode, self.named, self.batch = mode, named, batch
        self.adoption = Adoption() if adoption is None else adoption

    def __enter__(self) -> _Tap:
        if _TAP.mode is not None:
            raise RuntimeError(
                "fg.ghost_clip: a ghost-clipped step ran inside another one's loss "
                "(nested make_step calls with per_sample=fg.ghost_clip); call them one "
                "after the other."
            )
        _TAP.mode, _TAP.named, _TAP.batch, _TAP.used = self.mode, self.named, self.batch, 0
        _TAP.stack, _TAP.entries, _TAP.at, _TAP.kinds, _TAP.reached = [], [], 0, [], set()
        _TAP.adoption, _TAP.callers = self.adoption, []
        return _TAP

    def __exit__(self, *exc: object) -> None:
        _TAP.mode, _TAP.named, _TAP.shapes, _TAP.zs, _TAP.calls = None, (), None, (), None
        _TAP.used, _TAP.plan, _TAP.stack, _TAP.entries, _TAP.at = 0, (), [], [], 0
        _TAP.adoption, _TAP.callers = Adoption(), []
