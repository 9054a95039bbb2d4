"""Training steps: gradients, transformation and update as one pure function.

``make_step`` builds ``step(params, state, *batch) -> (params, state, loss)``. All
checks that need Python (names, structure, batch arity, donation safety) run
before tracing, so the traced step is pure tensor code: one graph under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad, grad_and_value, vmap

from ._base import GradientTransformation, Params, State, apply_updates
from ._model import PER_SAMPLE_BATCHNORM
from ._tree import copy_into, leaves_with_paths

LossFn = Callable[..., Any]


def _check_batch(batch: tuple[Any, ...], who: str) -> int:
    """Every batch argument is a tensor with the same leading (batch) size."""
    if not batch:
        raise ValueError(
            f"{who}: per-sample gradients need at least one batch tensor after params."
        )
    sizes = []
    for i, b in enumerate(batch):
        if not isinstance(b, Tensor) or b.dim() == 0:
            raise TypeError(
                f"{who}: batch argument {i} must be a tensor with a leading batch "
                f"dimension, got {type(b).__name__}"
                f"{' (0-d)' if isinstance(b, Tensor) else ''}. Bind constants into "
                "loss_fn with functools.partial instead."
            )
        sizes.append(b.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(
            f"{who}: batch arguments have different batch sizes {sizes}; every batch "
            "tensor must have the same leading dimension (one row per sample)."
        )
    return sizes[0]


def _explain_vmap_error(err: Exception) -> Exception | None:
    msg = str(err)
    if "Expected more than 1 value per channel when training" in msg or (
        "vmap" in msg and "running_mean" in msg
    ):
        return RuntimeError(f"{PER_SAMPLE_BATCHNORM}\nOriginal error: {msg}")
    return None


def per_sample_grads(loss_fn: LossFn, *, has_aux: bool = False) -> Callable[..., Any]:
    """Per-sample gradients: ``fn(params, *batch) -> {name: [B, *param.shape]}``.

    ``loss_fn(params, *batch) -> scalar`` is called on one sample at a time with
    its batch dimension restored as 1, so an ordinary mean-over-batch loss works
    unchanged. Built on ``vmap(grad(loss_fn))``: no Python loop over samples.
    With ``has_aux=True`` it returns ``(grads, aux)`` with aux batched.

    Example:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(3, 1)
        >>> loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()
        >>> g = fg.per_sample_grads(loss)(fg.params(model), torch.randn(8, 3), torch.randn(8, 1))
        >>> g["weight"].shape
        torch.Size([8, 1, 3])
    """

    def one(params: Params, *sample: Tensor) -> Any:
        return loss_fn(params, *(s.unsqueeze(0) for s in sample))

    g = grad(one, has_aux=has_aux)

    def fn(params: Params, *batch: Tensor) -> Any:
        _check_batch(batch, "fg.per_sample_grads")
        try:
            return vmap(g, in_dims=(None,) + (0,) * len(batch))(params, *batch)
        except (RuntimeError, ValueError) as err:
            better = _explain_vmap_error(err)
            if better is None:
                raise
            raise better from err

    return fn


def _meta(tree: Any) -> Any:
    return optree.tree_map(
        lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, tree
    )


def _check_donation(params: Params, state: State) -> None:
    seen: dict[int, str] = {}
    for where, tree in (("params", params), ("state", state)):
        for path, t in leaves_with_paths(tree, where):
            if t.requires_grad:
                raise ValueError(
                    f"make_step(donate=True): {path} requires grad, so it cannot be "
                    "updated in place. Pass fg.params(model) (detached) rather than "
                    "dict(model.named_parameters())."
                )
            key = t.untyped_storage().data_ptr()
            if t.numel() and key in seen:
                raise ValueError(
                    f"make_step(donate=True): {path} shares memory with {seen[key]}. "
                    "Donated tensors are written in place, so they must not be views of "
                    "each other; clone one of them (or tie the weights in the module and "
                    "take fg.params(model), which lists a tied parameter once)."
                )
            seen[key] = path


def make_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    has_aux: bool = False,
    compile: bool | dict[str, Any] = False,
    donate: bool = False,
    per_sample: GradientTransformation | None = None,
) -> Callable[..., tuple[Any, ...]]:
    """Build ``step(params, state, *batch) -> (params, state, loss)``.

    One step computes ``grads = torch.func.grad(loss_fn)(params, *batch)``, then
    ``updates, state = tx.update(grads, state, params)`` and
    ``params = fg.apply_updates(params, updates)``.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar`` (``(scalar, aux)`` with
            ``has_aux``).
        tx: the transformation, e.g. ``fg.chain(fg.per_group(rule, groups), fg.adam())``.
        has_aux: the step returns ``(params, state, loss, aux)``.
        compile: wrap the step in ``torch.compile(fullgraph=True)``; a dict adds
            other ``torch.compile`` options, e.g. ``{"backend": "aot_eager"}``.
        donate: write the new params and state into the given tensors in place and
            return those same tensors, so ``fg.params(model)`` keeps the module live.
        per_sample: a stateless transformation (e.g. ``fg.per_group(rule, groups)``)
            applied to every sample's gradients under ``vmap`` before they are
            averaged and handed to ``tx``. The loss is then the mean of the
            per-sample losses.

    Example:
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
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"make_step: tx must be a GradientTransformation (e.g. fg.adam()), got "
            f"{type(tx).__name__}."
        )
    if per_sample is not None and not isinstance(per_sample, GradientTransformation):
        raise TypeError(
            "make_step: per_sample must be a stateless GradientTransformation, e.g. "
            f"fg.per_group(fg.rules.clip_norm(1.0), groups); got {type(per_sample).__name__}."
        )
    try:
        sig: inspect.Signature | None = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables
        sig = None

    def grads_and_loss(params: Params, batch: tuple[Any, ...]) -> tuple[Params, Tensor, Any]:
        if per_sample is None:
            grads, out = grad_and_value(loss_fn, has_aux=has_aux)(params, *batch)
            loss, aux = out if has_aux else (out, None)
            return grads, loss, aux
        ps_state = per_sample.init(params)

        def one(p: Params, *sample: Tensor) -> Any:
            return loss_fn(p, *(s.unsqueeze(0) for s in sample))

        def one_grad(p: Params, *sample: Tensor) -> tuple[Params, Any]:
            g, out = grad_and_value(one, has_aux=has_aux)(p, *sample)
            g, _ = per_sample.update(g, ps_state, p)
            return g, out

        g, out = vmap(one_grad, in_dims=(None,) + (0,) * len(batch))(params, *batch)
        losses, aux = out if has_aux else (out, None)
        return {k: v.mean(0) for k, v in g.items()}, losses.mean(), aux

    def step_impl(params: Params, state: State, *batch: Any) -> tuple[Any, ...]:
        grads, loss, aux = grads_and_loss(params, batch)
        updates, new_state = tx.update(grads, state, params)
        new_params = apply_updates(params, updates)
        if donate:
            copy_into((params, state), (new_params, new_state))
            new_params, new_state = params, state
        out = (new_params, new_state, loss.detach())
        return (*out, aux) if has_aux else out

    if isinstance(compile, dict):
        impl = torch.compile(step_impl, **{**compile, "fullgraph": True})
    else:
        impl = torch.compile(step_impl, fullgraph=True) if compile else step_impl
    checked: set[tuple[Any, ...]] = set()

    def step(params: Params, state: State, *batch: Any) -> tuple[Any, ...]:
        # Python-side checks, once per distinct input structure: cheap on the hot path
        # and always before torch.compile starts tracing.
        if per_sample is not None:  # shapes can change between calls: always check
            _check_batch(batch, "make_step(per_sample=...)")
        flat, spec = optree.tree_flatten((params, state))  # type: ignore[arg-type,var-annotated]
        key = (spec, tuple(map(id, flat)) if donate else (), len(batch))
        if key not in checked:
            if sig is not None:
                try:
                    sig.bind(params, *batch)
                except TypeError as err:
                    raise TypeError(
                        f"make_step: loss_fn{sig} cannot be called with params and "
                        f"{len(batch)} batch argument(s): {err}. step(params, state, *batch) "
                        "passes *batch to loss_fn(params, *batch)."
                    ) from None
            if per_sample is not None:
                if leaves_with_paths(per_sample.init(_meta(params))):
                    raise TypeError(
                        "make_step: per_sample must be stateless (its init returns no "
                        "tensors), since it runs once per sample under vmap and nothing "
                        "could carry its state from step to step. Put stateful "
                        "transformations (Adam, add_noise, monitor) in tx instead."
                    )
            if donate:
                _check_donation(params, state)
            try:  # run the transformation's own checks on shape-only tensors
                mp = _meta(params)
                tx.update(mp, _meta(state), mp)
            except NotImplementedError:
                pass
            if len(checked) > 64:
                checked.clear()
            checked.add(key)
        try:
            return impl(params, state, *batch)
        except (RuntimeError, ValueError) as err:
            better = _explain_vmap_error(err) if per_sample is not None else None
            if better is None:
                raise
            raise better from err

    return step
