"""torch's private API, in one room.

funcgrad uses a few of torch's underscore names because no public API does the same
job yet. Every such use is here, and nowhere else in funcgrad (``torch._foreach_*``
stays where it is used: it is documented, and ``torch.optim`` is built on it).
``tests/test_compat.py`` exercises each one, so a torch release that drops or changes
one fails that test by name; ``tests/test_house.py`` fails when a private torch name
appears in another module.

Each entry says the torch version it was checked on and what replaces it when torch
drops it. Checked on torch 2.13.0 (the pinned CPU build) and 2.14.1 (the newest this
project's CI installs, ``make test-newest``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

# -- torch.utils._pytree ---------------------------------------------------------------
# The pytree that dynamo traces natively (optree's functions are traced through a
# polyfill, measured slower to trace: funcgrad/core/_tree.py). Checked on 2.13, 2.14.
# Replacement: torch.utils.pytree (public, optree-backed) once dynamo traces it as
# cheaply; then these become its tree_map / tree_map_only / register_pytree_node /
# tree_flatten / tree_unflatten.
import torch.utils._pytree as pytree

tree_map = pytree.tree_map
tree_map_only = pytree.tree_map_only
register_pytree_node = pytree.register_pytree_node
tree_flatten = pytree.tree_flatten  # (leaves, spec); None and numbers are leaves
tree_unflatten = pytree.tree_unflatten  # (leaves, spec) -> tree

# -- torch._C._functorch ---------------------------------------------------------------
# Whether a torch.func transform (grad, vmap, ...) is active, and whether a tensor is
# one of its wrappers. Checked on 2.13, 2.14. Replacement: none public yet
# (torch._functorch.pyfunctorch wraps the same stack); without them funcgrad raises
# the error below rather than guess (funcgrad/core/_compose.py).
_functorch = getattr(torch._C, "_functorch", None)
_peek = getattr(_functorch, "peek_interpreter_stack", None)
_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)


def _missing(name: str) -> RuntimeError:
    return RuntimeError(
        f"funcgrad needs torch._C._functorch.{name} to tell whether a torch.func "
        f"transform is active, and torch {torch.__version__} does not have it (it is a "
        "private API, present in the torch releases funcgrad is tested with). Install "
        "a tested torch (see the README) or report the version."
    )


def functorch_transform_active() -> bool:
    """Whether the ``torch.func`` interpreter stack is not empty (a transform runs)."""
    if _peek is None:
        raise _missing("peek_interpreter_stack")
    return _peek() is not None


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor wrapped by a ``torch.func`` transform."""
    if _wrapped is None:
        raise _missing("is_functorch_wrapped_tensor")
    return bool(_wrapped(t))


# -- torch.distributed._functional_collectives ----------------------------------------
# Collectives that dynamo captures as graph ops (torch.distributed's own calls break
# the graph). Checked on 2.13, 2.14 (all_reduce, reduce_scatter_single,
# all_gather_single). Replacement: the same module if torch makes it public
# (torch.distributed.functional_collectives has been discussed); imported on first
# use, so ``import funcgrad`` loads nothing of it.
def functional_collectives() -> ModuleType:
    """``torch.distributed._functional_collectives``, imported on first use."""
    import torch.distributed._functional_collectives as fc

    return fc


# -- torch.distributed.nn.functional: imported before any process group ----------------
# Its collectives take ``group=group.WORLD`` as a default argument, evaluated when the
# module is imported; torch._dynamo imports it. Imported after init_process_group, ten
# functions hold the world group for the life of the process: destroy_process_group
# then frees nothing, and gloo's threads (and rank 0's TCPStore) run on into
# interpreter exit, where a gloo thread that takes the GIL during finalization aborts
# the process ("terminate called without an active exception"). Imported before, the
# defaults are None. Checked on 2.13 and 2.14 (docs/distributed.md, "At exit").
# Repro (plain torch, six lines): docs/compile-notes.md, "Torch bugs, with their repros".
# Replacement: none needed once torch resolves that default per call.
def import_distributed_nn_early() -> None:
    """Import ``torch.distributed.nn.functional`` now (2-8 ms), before a process group
    exists, so that its default arguments do not pin the world group."""
    import torch.distributed as dist

    if dist.is_available():
        import torch.distributed.nn.functional  # noqa: F401


# -- optree's global namespace -----------------------------------------------------------
# optree registers a custom node only in a named namespace (a public rule: a library's
# registrations must not change another's flattening). A user's optree.tree_map(f,
# params) without a namespace then sees an fg.Flat as one leaf, where torch's pytree
# and funcgrad's own namespace see its per-name views. optree's global namespace is a
# private sentinel (registry.__GLOBAL_NAMESPACE). Checked with optree 0.20 (the version
# pip installs here with torch 2.13 and 2.14).
# Replacement: none; without the sentinel (a later optree) Flat is a leaf there.
def optree_global_namespace() -> Any:
    """optree's global namespace (its private sentinel), or None where absent."""
    import optree

    return getattr(optree.registry, "__GLOBAL_NAMESPACE", None)


# -- torch.nn.modules.module's global forward hooks ------------------------------------
# fg.ghost_clip's tap is a global forward hook that is in torch's hook table only while
# a ghost step runs: any hook there sends every nn.Module call in the process down
# Module.__call__'s slow path (1.09x on an unrelated 50-layer forward). A new
# register/remove per step makes a new key each time, and dynamo guards on the table's
# keys: a compiled ghost step would then recompile on every call. So the hook keeps the
# one key its first registration got, and goes into and out of the table by that key
# (the two dicts ``register_module_forward_hook(..., with_kwargs=True)`` writes). Its
# optional forward pre-hook (which taps the inputs of the calls a vmap-fallback module
# makes itself) goes into ``_global_forward_pre_hooks`` the same way, under its own key.
# Checked on 2.13, 2.14. Replacement: a public way to scope a global hook (none in 2.14).
class GlobalForwardHook:
    """A global forward hook (``with_kwargs=True``), and optionally a global forward
    pre-hook, put in and taken out of torch's tables under one key each, first in them:
    :meth:`add`, :meth:`remove` (both idempotent)."""

    def __init__(self, hook: Any, pre_hook: Any = None) -> None:
        from torch.nn.modules import module as _module

        self._module, self._hook, self._pre_hook = _module, hook, pre_hook
        handle = _module.register_module_forward_hook(hook, with_kwargs=True)
        self.key = handle.id
        handle.remove()
        self.pre_key: int | None = None
        if pre_hook is not None:
            handle = _module.register_module_forward_pre_hook(pre_hook)
            self.pre_key = handle.id
            handle.remove()

    @staticmethod
    def _first(table: Any, key: int, hook: Any) -> None:
        others = [(k, h) for k, h in table.items() if k != key]
        table.clear()
        table[key] = hook
        table.update(others)

    def add(self) -> None:
        """Into the tables, first: they run before any other global forward (pre-)hook,
        on the module's own output and input (torch runs them in the table's order)."""
        self._first(self._module._global_forward_hooks, self.key, self._hook)
        self._module._global_forward_hooks_with_kwargs[self.key] = True
        if self.pre_key is not None:
            self._first(self._module._global_forward_pre_hooks, self.pre_key, self._pre_hook)

    def remove(self) -> None:
        self._module._global_forward_hooks.pop(self.key, None)
        self._module._global_forward_hooks_with_kwargs.pop(self.key, None)
        if self.pre_key is not None:
            self._module._global_forward_pre_hooks.pop(self.pre_key, None)


# -- torch._inductor -------------------------------------------------------------------
# list_mode_options turns torch.compile's ``mode=`` into inductor options, so funcgrad
# can add ``emulate_precision_casts`` (torch.compile takes mode or options, not both).
# Checked on 2.13, 2.14. Replacement: torch.compile accepting mode and options together.
def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The inductor options that ``torch.compile(mode=mode)`` stands for."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


# -- torch.amp.GradScaler._get_scale_async ---------------------------------------------
# The scaler's current scale as a device tensor, without the host sync of
# get_scale(). Checked on 2.13, 2.14. Replacement: get_scale() (public, one sync per
# call), which is what this falls back to where the private method is missing.
def grad_scaler_scale(scaler: Any) -> torch.Tensor | float | None:
    """A GradScaler's current scale: a tensor where torch offers one without a host
    sync, else ``scaler.get_scale()``; None when the scaler is disabled."""
    if not scaler.is_enabled():
        return None
    get_async = getattr(scaler, "_get_scale_async", None)
    scale = get_async() if get_async is not None else None
    return scale if scale is not None else scaler.get_scale()


# -- torch.compiler.is_compiling: one flag for the whole process -----------------------
# torch.compiler.is_compiling() reads a module-level flag that dynamo sets while it
# traces, and every thread reads it: a thread stepping eagerly while another one
# builds the compiled step (fg.make_step(compile="async")) would take funcgrad's
# traced branches (and, e.g., refuse fg.params). is_dynamo_compiling() is False when
# run and True only where dynamo traces the call, in the tracing thread alone.
# funcgrad's Python runs under torch.compile only as dynamo traces it, so the two
# agree there. Checked on 2.13, 2.14. Replacement: none needed while
# is_dynamo_compiling stays public; if torch makes is_compiling thread-local
# (pytorch/pytorch#118260), either will do.


def compiling() -> bool:
    """Whether dynamo is tracing this call (in this thread): funcgrad's traced branches."""
    return torch.compiler.is_dynamo_compiling()


# -- torch.compile(...).aot_compile: compiling a step without running it ---------------
# fg.make_step(compile="async") across torch.distributed ranks builds the compiled step
# in a background thread; running it there (as the single-process build does, on
# copies) would send its collectives beside the eager thread's, and another rank would
# pair them wrongly. aot_compile traces and compiles without running. Experimental in
# torch (documented "subject to change"). What funcgrad needs around it, each checked
# on 2.13 and 2.14:
# - torch._dynamo.exc.TensorifyScalarRestartAnalysis: where torch.compile restarts its
#   analysis after specializing a float, aot_compile raises; the specialization is
#   remembered (TensorifyState, process-wide), so calling again succeeds.
# - its guards are built for saving, and ID/closure/dict-version guards cannot be
#   saved: a guard_filter_fn keeps the guards on the arguments (shapes, dtypes,
#   strides, structure) and drops those on the step's own closure (the same objects
#   for the life of the process: nothing to guard), as
#   CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES lists them.
# Replacement: torch.compile with a public "compile now, run later" entry point.
def compile_without_running(
    fn: Any, options: dict[str, Any], args: tuple[Any, ...], tries: int = 4
) -> Any:
    """``torch.compile(fn, fullgraph=True, **options)`` compiled for ``fn(*args)``
    without running it. Returns a callable with ``guard_check(*args)`` (whether these
    arguments fit the compiled graph) that runs the compiled graph."""
    import inspect

    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    arguments = set(inspect.signature(fn).parameters)

    def on_arguments(entries: Any) -> list[bool]:
        return [
            e.name.split("[", 1)[0].split(".", 1)[0] in arguments
            and not e.is_global
            and e.guard_type not in unsaved
            and not unsaved.intersection(e.derived_guard_types)
            for e in entries
        ]

    for attempt in range(tries):
        inner = {**(options.get("options") or {}), "guard_filter_fn": on_arguments}
        compiled = torch.compile(fn, **{**options, "options": inner, "fullgraph": True})
        try:
            return compiled.aot_compile((args, {}))  # type: ignore[attr-defined]
        except TensorifyScalarRestartAnalysis:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


# -- torch._fused_adam_ / _fused_adamw_ / _fused_sgd_ ------------------------------------
# The kernels of torch.optim.Adam/AdamW/SGD(fused=True), CPU and CUDA: one pass over each
# parameter, gradient and moment, in place (fg.Optimizer's eager step,
# funcgrad/optim/_fused.py). Checked on 2.13, 2.14 (signatures as in
# aten/src/ATen/native/native_functions.yaml). Replacement: none public; without them
# fg.Optimizer takes its general path (funcgrad's own kernel: same math, not the same
# rounding as torch's fused).
def fused_adam(*args: Any, decoupled: bool, **kwargs: Any) -> None:
    """``torch._fused_adamw_`` (decoupled weight decay) or ``torch._fused_adam_``."""
    (torch._fused_adamw_ if decoupled else torch._fused_adam_)(*args, **kwargs)


def fused_sgd(*args: Any, **kwargs: Any) -> None:
    """``torch._fused_sgd_``."""
    torch._fused_sgd_(*args, **kwargs)


def fused_adagrad(*args: Any, **kwargs: Any) -> None:
    """``torch._fused_adagrad_``."""
    torch._fused_adagrad_(*args, **kwargs)
