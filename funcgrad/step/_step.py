"""Training steps: gradients, transformation and update as one pure function.

``make_step`` builds ``step(params, state, *batch) -> (params, state, loss)``: it
checks its arguments, then dispatches to one of three step builders and wraps what it
returns in the one step function that runs the checks and explains errors.

What the builders share (:func:`_core`, and the checks in ``make_step``):

- :class:`funcgrad.step._checks.Checks`: everything that needs Python (names, structure,
  batch arity, donation safety) runs before tracing, so the traced step is pure
  tensor code;
- ``_gradients.gradient_function``: ``torch.func.grad`` of the loss, or per-sample
  gradients (built from the same vmapped function as ``fg.per_sample_grads``, in
  ``_per_sample.py``);
- ``compute``: ``tx.update`` + ``apply_updates``, a pure function.

The builders: :func:`_eager_step` (``compile=False``): with ``donate=True``,
:func:`funcgrad.core._tree.commit` writes every result into the given tensors afterwards,
in one multi-tensor copy; :func:`_compiled_step` (``compile=True``): the graph writes
them itself, each write made to depend on every gradient (``_gradients.after_gradients``),
with Ctrl-C held back while the graph runs; :func:`_gradients_step`
(``compile="gradients"``): the gradient function compiled (a graph that writes
nothing), the rest as in the eager step.

So a step whose forward or backward raises (eagerly: anything in the step) changes
nothing, an interrupted step is applied whole or not at all, and params and state are
never left half-updated. What the compiled step does not cover: an exception raised
*inside* a custom transformation at run time, after writes began (funcgrad's own
transformations have no run-time failure); a two-phase write for that would cost a
second pass over everything (docs/compile-notes.md, "Figures behind the code").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import (
    GradientTransformation,
    LossFn,
    Params,
    State,
    apply_updates,
    require_transformation,
    updates_as_params,
)
from ..core._compose import transform_active
from ..core._flat import Flat, leaves
from ..core._scratch import Scratch, lending
from ..core._tree import commit, copy_into, sigint_held
from ..model._errors import (
    PER_SAMPLE_BATCHNORM,
    explain_buffer_write,
    explain_compile_failure,
    reraise,
)
from ..model._model import watching_buffers
from . import _scalars
from ._async import Background, Run
from ._checks import Checks, compile_scope
from ._ghost import GhostGradients, hooked
from ._gradients import after_gradients, autograd_gradients, ghost_of, gradient_function
from ._handle import Step, result_type
from ._minimize import minimize_step


class _Core(NamedTuple):
    """What the three step builders share: the gradient function (traced), the pure
    step's pieces, and the options that decide how results are written."""

    gradients: Callable[..., tuple[Params, Tensor, Any, Any]]
    compute: Callable[..., Any]
    pure_step: Callable[..., tuple[Any, ...]]
    donate: bool
    buffers: bool
    per_sample: bool
    # Around every call of the step and its background build: fg.ghost_clip's hook in
    # torch's table for the call (_ghost.hooked), else nothing.
    scope: Callable[[], contextlib.AbstractContextManager[Any]]


def _core(
    loss_fn: LossFn,
    tx: GradientTransformation,
    has_aux: bool,
    per_sample: GradientTransformation | None,
    donate: bool,
    buffers: bool,
) -> _Core:
    gradients = gradient_function(loss_fn, has_aux, per_sample, buffers)

    def compute(
        grad_fn: Callable[..., Any],
        params: Params,
        state: State,
        *args: Any,
        apply: bool = True,
        record: bool = True,
    ) -> Any:
        """``(new params, state[, buffers]), grads, (loss[, aux])``; with ``apply=False``
        the updates in place of the new params. ``record=False`` (the eager step, where
        nothing differentiates through the update) runs ``tx`` without autograd, so its
        fast paths need not look for tensors that require grad (funcgrad/core/_compose.py)."""
        flat = params if isinstance(params, Flat) else None
        # Flat params (fg.params(model)): the loss sees per-name views, and the
        # per-name gradients are gathered into the flat layout in one cat per buffer.
        named, loss, new_bufs, aux = grad_fn(params if flat is None else flat.views(), *args)
        grads: Any = named if flat is None else Flat._packed_from(named, flat.layout)
        with contextlib.nullcontext() if record else torch.no_grad():
            updates, new_state = tx.update(grads, state, params)
            new: tuple[Any, ...] = (
                apply_updates(params, updates) if apply else updates,
                new_state,
            )
        new += (new_bufs,) if buffers else ()
        return new, grads, (loss.detach(),) + ((aux,) if has_aux else ())

    def pure_step(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        new, _, rest = compute(gradients, params, state, *args)
        return new + rest

    scope = hooked if ghost_of(per_sample) is not None else contextlib.nullcontext
    return _Core(gradients, compute, pure_step, donate, buffers, per_sample is not None, scope)


def _given(core: _Core, params: Params, state: State, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The tensors a donated step writes into: params, state (and buffers)."""
    return (params, state, args[0]) if core.buffers else (params, state)


def _traced_step(core: _Core) -> Callable[..., tuple[Any, ...]]:
    """What ``compile=True`` hands to ``torch.compile``: the pure step, or donated, the
    step whose graph writes into the given tensors itself (inductor fuses the writes
    into the update kernels: no second pass, no new buffers)."""
    if not core.donate:
        return core.pure_step

    def donated_step(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        new, grads, rest = core.compute(core.gradients, params, state, *args)
        given = _given(core, params, state, args)
        copy_into(given, after_gradients(grads, given, new))
        return given + rest

    return donated_step


def _held(core: _Core, impl: Callable[..., tuple[Any, ...]]) -> Run:
    """``impl`` as a :data:`Run`; donated, with Ctrl-C held back while it runs (it
    cannot land between two of the graph's kernels)."""

    def run(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if not core.donate:
            return impl(params, state, *args)
        with sigint_held():
            return impl(params, state, *args)

    return run


def _compiled_step(core: _Core, options: dict[str, Any]) -> Run:
    """``compile=True``: the whole step as one graph (the state's 0-d float64 CPU
    tensors passed as 1-element views: funcgrad/step/_scalars.py)."""
    traced = _scalars.lowered(_traced_step(core), core.donate)
    return _scalars.Lifted(
        _held(core, torch.compile(traced, **{**options, "fullgraph": True})), core.donate
    )


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.scratch = Scratch()


def _eager_step(
    core: _Core,
    gradients: Callable[..., Any],
    fast: Callable[..., Any] | None = None,
) -> Run:
    """The step run eagerly around ``gradients`` (``fast`` instead once the inputs'
    structure went through it). Donated, the results are committed into the given
    tensors afterwards in one multi-tensor pass; large CPU results are kept for the
    next step (funcgrad/core/_scratch.py), one scratch per thread."""
    per_thread = _PerThread()

    def run(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        with sigint_held():  # once for the step: fg.call's and commit's hold nothing more
            return step(fresh, params, state, *args)

    def step(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        scratch = per_thread.scratch
        grad_fn = gradients if fresh or fast is None else fast
        try:
            lend = lending(scratch) if core.donate else contextlib.nullcontext()
            with watching_buffers(), lend:
                # Donated, the first result is the updates (added to the params at commit).
                new, _, rest = core.compute(
                    grad_fn, params, state, *args, apply=not core.donate, record=False
                )
        except Exception:
            scratch.forget()
            raise
        out = new + rest
        if not core.donate:
            return out
        given = _given(core, params, state, args)
        added = updates_as_params(params, out[0])
        commit(given[1:], out[1 : len(given)], add_to=leaves(params), add=added)
        scratch.reclaim()
        return given + out[len(given) :]

    return run


def _gradients_step(core: _Core, options: dict[str, Any]) -> Run:
    """``compile="gradients"``: the forward and backward as one graph, which writes
    nothing; the rest is the eager step."""
    compiled = torch.compile(core.gradients, **{**options, "fullgraph": True})

    def gradients(params: Params, *args: Any) -> tuple[Params, Tensor, Any, Any]:
        try:
            return compiled(params, *args)
        except Exception as err:
            eager = lambda: core.gradients(params, *args)  # noqa: E731
            reraise(err, explain_compile_failure(err, eager, 'compile="gradients"'))

    return _eager_step(core, gradients)


def make_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    has_aux: bool = False,
    compile: bool | str | dict[str, Any] = False,
    donate: bool = False,
    per_sample: GradientTransformation | None = None,
    buffers: bool = False,
) -> Step:
    """Build ``step(params, state, *batch) -> (params, state, loss)``.

    One step computes ``grads = torch.func.grad(loss_fn)(params, *batch)``, then
    ``updates, state = tx.update(grads, state, params)`` and
    ``params = fg.apply_updates(params, updates)``. The step is a callable object:
    ``step.is_compiled`` says whether its last call ran compiled, and
    ``step.wait_compiled(timeout=None)`` waits for a ``compile="async"`` build (else
    it says whether the step is compiled).

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar`` (``(scalar, aux)`` with
            ``has_aux``; ``loss_fn(params, buffers, *batch)`` with ``buffers``).
        tx: the transformation, e.g. ``fg.chain(fg.per_group(rule, groups), fg.adam())``.
        has_aux: the step returns ``aux`` last.
        compile: wrap the step in ``torch.compile(fullgraph=True)``; a dict adds
            other ``torch.compile`` options, e.g. ``{"backend": "aot_eager"}``.
            ``"gradients"`` (or ``{"scope": "gradients", ...}``) compiles only the
            gradient computation (forward and backward, one graph that writes
            nothing) and runs ``tx`` and the update eagerly, as
            ``torch.compile(model)`` with a ``torch.optim`` optimizer does: the
            first call compiles about as fast as the model alone, and every step
            runs the update as the eager step does (docs/compile-notes.md has the
            measured trade-off). ``"async"`` (or ``{"scope": "async", ...}``):
            the call returns after an eager step, and steps run eagerly (the same
            math and guarantees) while the whole step compiles in a background
            thread; the first call after the build is done runs compiled. The
            step's ``is_compiled`` says which path the last call took;
            ``step.wait_compiled(timeout)`` blocks until the build ends. A build
            that fails warns once and the step stays eager. Across
            ``torch.distributed`` ranks every rank switches at the same step
            (they agree by one small all-reduce per eager step; the build
            compiles without running, so inductor or an AOT-autograd backend).
            A step with random ops (dropout) is not reproduced draw for draw
            while the build runs: torch's trace saves and restores the global
            generator (docs/compile-notes.md). On a CPU the build shares the
            interpreter with the eager steps (the GIL) and takes longer than
            ``compile=True``'s (docs/compile-notes.md, "compile='async'").
            ``"step"`` is the same as ``True``. With inductor,
            float16/bfloat16 results are rounded where eager rounds them
            (``emulate_precision_casts``, unless the options set it), so the compiled
            update equals the eager one bit for bit (docs/compile-notes.md).
        donate: write the new params, state (and buffers) into the given tensors in
            place and return those same tensors, so ``fg.params(model)`` and
            ``fg.buffers(model)`` keep the module live.
        per_sample: a stateless transformation (e.g. ``fg.per_group(rule, groups)``)
            applied to every sample's gradients under ``vmap`` before they are
            averaged and handed to ``tx``. The loss is then the mean of the
            per-sample losses.
        buffers: for models that update buffers in forward (train-mode BatchNorm's
            running statistics): the step is ``step(params, state, buffers, *batch)
            -> (params, state, buffers, loss)`` and ``loss_fn(params, buffers,
            *batch)`` passes them on with ``fg.call(model, params, x,
            buffers=buffers)``. The buffers come out as an eager train-mode forward
            leaves them; they are inputs and outputs of the pure step, so it stays
            one graph.

    Returns:
        the step, a :class:`~funcgrad.step._handle.Step`. Each call returns
        ``(params, state, loss)``, a plain tuple; with ``buffers=True`` a NamedTuple
        ``(params, state, buffers, loss)``, with ``has_aux`` one with ``aux`` last:
        unpack it as a tuple, or read ``out.loss``, ``out.aux``.

    Under a ``torch.func`` transform (``vmap`` over an ensemble's stacked params,
    ``grad`` through training steps for meta-learning) the step runs its pure math
    eagerly, whatever ``compile`` says, and cannot be donated. To compile such a
    loop, compile the transformed function written from ``tx.update`` and
    ``fg.apply_updates`` (``examples/ensemble.py``, ``examples/maml_sine.py``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()
        >>> tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)),
        ...               fg.adam(lr=1e-2))
        >>> params = fg.params(model)
        >>> state = tx.init(params)
        >>> step = fg.make_step(loss, tx, donate=True)
        >>> params, state, l = step(params, state, torch.randn(4, 2), torch.randn(4, 1))
        >>> int(state.inner_states[1].count), params["weight"].data_ptr() == model.weight.data_ptr()
        (1, True)

        Only the forward and backward compiled (inductor), ``tx`` eager; options for
        ``torch.compile`` go in a dict with ``"scope"``:

        >>> step = fg.make_step(loss, tx, compile="gradients", donate=True)
        >>> step = fg.make_step(
        ...     loss, tx, compile={"scope": "gradients", "backend": "aot_eager"}, donate=True
        ... )

        With train-mode BatchNorm:

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        >>> bn_loss = lambda p, b, x: fg.call(net, p, x, buffers=b).square().mean()
        >>> step = fg.make_step(bn_loss, fg.adam(), buffers=True, donate=True)
        >>> p, b = fg.params(net), fg.buffers(net)
        >>> out = step(p, fg.adam().init(p), b, torch.randn(4, 2))
        >>> out._fields, int(out.buffers["1.num_batches_tracked"])
        (('params', 'state', 'buffers', 'loss'), 1)
    """
    require_transformation(tx, "fg.make_step: tx")
    if per_sample is not None:
        require_transformation(
            per_sample, "fg.make_step: per_sample", "fg.ghost_clip(1.0), stateless"
        )
    if per_sample is not None and buffers:
        raise ValueError(
            "fg.make_step: per_sample= and buffers=True do not go together. A model that "
            f"updates buffers in forward is usually train-mode BatchNorm: "
            f"{PER_SAMPLE_BATCHNORM}"
        )
    if tx.facts.minimize is not None:  # fg.lbfgs: it evaluates the loss itself
        return minimize_step(
            loss_fn, tx, has_aux=has_aux, compile=compile, donate=donate,
            per_sample=per_sample, buffers=buffers,
        )  # fmt: skip
    scope, options = compile_scope(compile)
    core = _core(loss_fn, tx, has_aux, per_sample, donate, buffers)
    background: Background | None = None
    if scope == "step":
        run: Run = _compiled_step(core, options)
    elif scope == "gradients":
        run = _gradients_step(core, options)
    else:
        # After a call with these inputs' structure went through torch.func (its checks
        # give the clear errors): plain autograd, the same values, faster.
        fast = autograd_gradients(loss_fn, has_aux, buffers) if per_sample is None else None
        run = _eager_step(core, core.gradients, fast)
        if scope == "async":
            run = background = Background(
                _compiled_step(core, options), run, core, options,
                lambda: _traced_step(core), lambda impl: _held(core, impl),
            )  # fmt: skip
    checks = Checks(loss_fn, tx, per_sample, donate, buffers)
    compiled = scope == "step"
    pure_buffers = buffers and not donate and scope in ("step", "gradients", "async")

    def scoped(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        with core.scope():
            return call(params, state, *args)

    step = Step(scoped, result=result_type(buffers, has_aux))

    def call(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if isinstance(params, Flat):
            params.check_attached("fg.make_step")
        if transform_active():
            # Under torch.func.grad/vmap (meta-learning, ensembles): the pure step's
            # math, eagerly; no fast path (plain autograd, scratch buffers), no write.
            if donate:
                raise ValueError(
                    "fg.make_step(donate=True): the step runs under a torch.func "
                    "transform (grad, vmap, ...), where its results are the transform's "
                    "outputs and cannot be written into the given tensors. Build the "
                    "step with donate=False and use what it returns."
                )
            checks(params, state, args)
            return core.pure_step(params, state, *args)
        fresh = checks(params, state, args)
        # A traced ghost probe watches no parameter use: fg.ghost_clip's eager one first.
        if fresh and scope in ("step", "gradients") and isinstance(core.gradients, GhostGradients):
            core.gradients.check(params.views() if isinstance(params, Flat) else params, *args)
        if pure_buffers and isinstance(args[0], Mapping):
            # Not donated: the given buffers are not written, and a compiled step sees
            # the same aliasing on every call (the first call's fg.buffers(model) are
            # the module's own tensors, later calls' the step's outputs: dynamo guards
            # on that, and would compile the step twice). A copy of the buffers only.
            args = (
                {k: v.clone() if isinstance(v, Tensor) else v for k, v in args[0].items()},
                *args[1:],
            )
        try:
            out = run(fresh, params, state, *args)
        except Exception as err:
            better: Exception | None = explain_buffer_write(err, per_sample=core.per_sample)
            if better is None and (compiled or (background is not None and background.ready)):
                better = explain_compile_failure(err, lambda: core.pure_step(params, state, *args))
            reraise(err, better)
        step.is_compiled = compiled or (background is not None and background.is_compiled)
        return out

    if background is not None:
        step._wait = background.wait
    return step
