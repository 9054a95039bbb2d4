"""What a training step checks in Python before anything is traced.

:class:`Checks` validates the inputs of a step (names, structure, batch arity,
donation safety, a shape-only dry run of ``tx.update``) whenever their structure
changes;
:func:`compile_scope` reads ``make_step``'s ``compile=``. Under ``torch.compile``
none of this runs per step: the traced step is pure tensor code.
"""

from __future__ import annotations

import inspect
import itertools
import os
import warnings
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from .. import _compat
from ..core._base import GradientTransformation, LossFn, Params, State
from ..core._compose import is_transformed, transform_active
from ..core._tree import BUFFERS, tensor_paths
from ..model._errors import HOST_READ
from ._per_sample import check_batch


def _meta(tree: Any) -> Any:
    return optree.tree_map(
        lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t,
        tree,
        namespace=BUFFERS,
    )


def _check_tensors(
    params: Params, state: State, buffers: Mapping[str, Tensor], donate: bool
) -> None:
    """Leaves the step can use: no autograd history, real data, and (donated) no
    two views of one memory."""
    spans: dict[int, list[tuple[int, int, int, str]]] = {}
    seen = 0
    for where, tree in (("params", params), ("state", state), ("buffers", buffers)):
        for path, t in tensor_paths(tree, where):
            # (under torch.func.grad the inputs are the transform's tracked tensors)
            if t.requires_grad and not is_transformed(t):
                raise ValueError(
                    f"fg.make_step: {path} requires grad. The step differentiates with "
                    "torch.func.grad itself; a tensor that requires grad would make every "
                    "step extend an autograd history (memory grows without bound) and "
                    "cannot be updated in place. Pass fg.params(model) (detached) rather "
                    "than dict(model.named_parameters())."
                )
            if t.is_meta:
                raise ValueError(
                    f"fg.make_step: {path} is on the meta device: it has a shape but no "
                    "data to train. Materialize the model first, e.g. "
                    "model.to_empty(device='cpu') and then initialize its parameters "
                    "(or load a checkpoint), and take fg.params(model) after that."
                )
            if donate and t.numel():
                seen += 1
                spans.setdefault(t.untyped_storage().data_ptr(), []).append((*_span(t), seen, path))
    for found in spans.values():  # donated: no two tensors may overlap in memory
        found.sort()
        for a, b in itertools.pairwise(found):
            if b[0] < a[1]:  # (named in the order the step's inputs list them)
                first, second = (a[3], b[3]) if a[2] < b[2] else (b[3], a[3])
                raise ValueError(
                    f"fg.make_step(donate=True): {second} shares memory with {first}. "
                    "Donated tensors are written in place, so they must not be views of "
                    "each other; clone one of them (or tie the weights in the module and "
                    "take fg.params(model), which lists a tied parameter once)."
                )


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` reaches: ``(start, end)``. The views of one
    flat buffer (``fg.params(model)``) are disjoint spans of one storage."""
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.storage_offset() * t.element_size()
    return int(start), int(start + reach * t.element_size())


class Checks:
    """The checks that need Python, run before anything is traced.

    They run again whenever the structure of the inputs (or, with donation, the
    identity of the donated tensors) differs from the previous call's; a training
    loop that calls the step with the same dicts pays one tuple comparison per step.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        tx: GradientTransformation,
        per_sample: GradientTransformation | None,
        donate: bool,
        buffers: bool,
    ) -> None:
        self.tx, self.per_sample, self.donate, self.buffers = tx, per_sample, donate, buffers
        try:
            self.sig: inspect.Signature | None = inspect.signature(loss_fn)
        except (TypeError, ValueError):  # builtins and some C callables
            self.sig = None
        self.last: Any = None

    def __call__(self, params: Params, state: State, args: tuple[Any, ...]) -> bool:
        """Run the checks if the inputs' structure changed; True if they ran."""
        if self.buffers:
            if not args or not isinstance(args[0], Mapping):
                got = type(args[0]).__name__ if args else "nothing"
                raise TypeError(
                    "fg.make_step(buffers=True): the step is called as step(params, state, "
                    f"buffers, *batch), with buffers a dict such as fg.buffers(model); got "
                    f"{got} in third place."
                )
            for name, b in args[0].items():
                if not isinstance(b, Tensor):
                    raise TypeError(
                        f"fg.make_step(buffers=True): buffers['{name}'] is a "
                        f"{type(b).__name__}, not a tensor. Pass fg.buffers(model)."
                    )
        if self.per_sample is not None:  # shapes can change between calls: always check
            check_batch(args, "fg.make_step(per_sample=...)")
        flat, spec = optree.tree_flatten(  # type: ignore[var-annotated]
            (params, state, args[:1] if self.buffers else ()),  # type: ignore[arg-type]
            namespace=BUFFERS,
        )
        key = (spec, tuple(map(id, flat)) if self.donate else (), len(args))
        if key == self.last:
            return False
        if self.sig is not None:
            try:
                self.sig.bind(params, *args)
            except TypeError as err:
                head = "params, buffers" if self.buffers else "params"
                n = len(args) - self.buffers
                raise TypeError(
                    f"fg.make_step: loss_fn{self.sig} cannot be called with {head} and "
                    f"{n} batch argument(s): {err}. step(params, state, "
                    f"{'buffers, ' if self.buffers else ''}*batch) passes *batch to "
                    f"loss_fn({head}, *batch)."
                ) from None
        if self.per_sample is not None and tensor_paths(self.per_sample.init(_meta(params))):
            raise TypeError(
                "fg.make_step: per_sample must be stateless (its init returns no "
                "tensors), since it runs once per sample under vmap and nothing "
                "could carry its state from step to step. Put stateful "
                "transformations (Adam, add_noise, monitor) in tx instead."
            )
        _check_tensors(params, state, args[0] if self.buffers else {}, self.donate)
        try:  # run the transformation's own checks on shape-only tensors
            # (not under a torch.func transform: the step then runs eagerly, where a
            # host read is allowed, and meta tensors cannot be made inside grad)
            if not transform_active():
                mp = _meta(params)
                self.tx.update(mp, _meta(state), mp)
        except NotImplementedError:
            pass
        except RuntimeError as err:
            if "meta tensors" not in str(err):
                raise
            raise TypeError(f"fg.make_step: tx.update {HOST_READ}") from err
        self.last = key
        return True


_SCOPES = ("step", "gradients", "async")


def compile_scope(compile: bool | str | Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``make_step``'s ``compile=`` as (what is compiled, ``torch.compile`` options):
    ``True`` is ``("step", {})``, ``"gradients"`` is ``("gradients", {})``, a dict
    may name ``"scope"`` and passes its other keys to ``torch.compile``."""
    if isinstance(compile, Mapping):
        options = dict(compile)
        scope = options.pop("scope", "step")
    elif isinstance(compile, str):
        options, scope = {}, compile
    else:
        if compile:
            warn_shared_cache(os.environ)
        return ("step", eager_rounding({})) if compile else (None, {})
    if scope not in _SCOPES:
        raise ValueError(
            f"fg.make_step: compile scope {scope!r} is not one of {_SCOPES}. Use "
            'compile=True (the whole step as one graph), compile="gradients" (only the '
            'forward and backward as one graph; tx runs eagerly), compile="async" (eager '
            "steps while the whole step compiles in the background), a dict of "
            'torch.compile options (with "scope": "gradients" for the latter), or False.'
        )
    warn_shared_cache(os.environ)
    return scope, eager_rounding(options)


def warn_shared_cache(environ: Mapping[str, str]) -> None:
    """Warn when ``ATEN_CPU_CAPABILITY`` is set and inductor's on-disk cache is the
    default one, shared with processes on the CPU's own kernel path.

    torch 2.13's cache does not tell kernels built for one CPU capability from
    another's: a process on AVX-512 that reads kernels compiled under
    ``ATEN_CPU_CAPABILITY=avx2`` computes garbage or corrupts its heap (glibc aborts
    such as ``free(): invalid pointer``; the repro, plain torch, is in
    docs/compile-notes.md, "Torch bugs, with their repros"). Warnings pass a Python's
    default filter once per place, so this needs no registry of its own."""
    capability = environ.get("ATEN_CPU_CAPABILITY")
    if capability and not environ.get("TORCHINDUCTOR_CACHE_DIR"):
        warnings.warn(
            f"ATEN_CPU_CAPABILITY={capability} is set and torch.compile's on-disk cache is "
            "the default one, shared with processes on other kernel paths. torch's cache "
            "does not tell kernels built for one CPU capability from another's, and a "
            "process that reads the other's kernels computes wrong values or corrupts its "
            "heap (funcgrad's docs/testing.md, 'On another CPU'). Give each capability its own "
            f"cache: TORCHINDUCTOR_CACHE_DIR=/some/dir/inductor-{capability}.",
            stacklevel=3,
        )


def eager_rounding(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` options with inductor rounding each float16/bfloat16 result
    where eager torch does (``emulate_precision_casts``), unless the options set it.

    Without it, inductor keeps a fused kernel's low-precision intermediates in float32:
    measured on torch 2.13 (CPU), one compiled ``fg.muon`` step on bfloat16 params was
    36% of the update away from the eager one (AdamW 12%, Adam 3%); with it, every
    funcgrad optimizer's compiled update equals the eager one bit for bit in bfloat16
    and float16 (tests/test_low_precision.py, docs/compile-notes.md). ``mode=`` is
    turned into its inductor options (``funcgrad._compat.inductor_mode_options``), since
    ``torch.compile`` takes ``mode`` or ``options``, not both."""
    if options.get("backend", "inductor") != "inductor":
        return options
    out = dict(options)
    inner = dict(out.get("options") or {})
    mode = out.pop("mode", None)
    if mode is not None:
        inner = {**_compat.inductor_mode_options(mode), **inner}
    inner.setdefault("emulate_precision_casts", True)
    out["options"] = inner
    return out
