"""Training steps: gradients, transformation and update as one pure function.

``make_step`` builds ``step(params, state, *batch) -> (params, state, loss)`` from
three parts, each a function of its own:

- :class:`_Checks`: everything that needs Python (names, structure, batch arity,
  donation safety) runs before tracing, so the traced step is pure tensor code;
- :func:`_gradients`: ``torch.func.grad`` of the loss, or per-sample gradients
  (built from the same vmapped function as :func:`per_sample_grads`);
- ``update``: ``tx.update`` + ``apply_updates``, then (``donate=True``) writes into
  the given tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from ._base import GradientTransformation, Params, State, apply_updates
from ._model import explain_buffer_write
from ._tree import copy_into, tensor_paths

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


def _vmapped_grads(
    loss_fn: LossFn, has_aux: bool, each: GradientTransformation | None = None
) -> Callable[..., tuple[Params, Tensor, Any]]:
    """``fn(params, *batch) -> (grads, losses, aux)``, all with a leading batch dim.

    ``loss_fn`` sees one sample at a time with its batch dimension restored as 1, so
    a mean-over-batch loss works unchanged; ``each`` (stateless) transforms every
    sample's gradients inside the vmap.
    """

    def one(params: Params, *sample: Tensor) -> Any:
        return loss_fn(params, *(s.unsqueeze(0) for s in sample))

    def one_grad(params: Params, *sample: Tensor) -> tuple[Params, Any]:
        g, out = grad_and_value(one, has_aux=has_aux)(params, *sample)
        if each is not None:
            g, _ = each.update(g, each.init(params), params)
        return g, out

    def fn(params: Params, *batch: Tensor) -> tuple[Params, Tensor, Any]:
        g, out = vmap(one_grad, in_dims=(None,) + (0,) * len(batch))(params, *batch)
        losses, aux = out if has_aux else (out, None)
        return g, losses, aux

    return fn


def _raise_explained(err: BaseException, per_sample: bool) -> None:
    better = explain_buffer_write(err, per_sample=per_sample)
    if better is not None:
        raise better from err


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
    batched = _vmapped_grads(loss_fn, has_aux)

    def fn(params: Params, *batch: Tensor) -> Any:
        _check_batch(batch, "fg.per_sample_grads")
        try:
            g, _, aux = batched(params, *batch)
        except (RuntimeError, ValueError) as err:
            _raise_explained(err, per_sample=True)
            raise
        return (g, aux) if has_aux else g

    return fn


def _gradients(
    loss_fn: LossFn, has_aux: bool, per_sample: GradientTransformation | None
) -> Callable[..., tuple[Params, Tensor, Any]]:
    """``fn(params, *batch) -> (grads, loss, aux)`` for the step (traced)."""
    if per_sample is None:

        def plain(params: Params, *batch: Any) -> tuple[Params, Tensor, Any]:
            grads, out = grad_and_value(loss_fn, has_aux=has_aux)(params, *batch)
            loss, aux = out if has_aux else (out, None)
            return grads, loss, aux

        return plain
    batched = _vmapped_grads(loss_fn, has_aux, each=per_sample)

    def averaged(params: Params, *batch: Any) -> tuple[Params, Tensor, Any]:
        g, losses, aux = batched(params, *batch)
        return {k: v.mean(0) for k, v in g.items()}, losses.mean(), aux

    return averaged


def _meta(tree: Any) -> Any:
    return optree.tree_map(
        lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, tree
    )


def _check_donation(params: Params, state: State) -> None:
    seen: dict[int, str] = {}
    for where, tree in (("params", params), ("state", state)):
        for path, t in tensor_paths(tree, where):
            if t.requires_grad:
                raise ValueError(
                    f"fg.make_step(donate=True): {path} requires grad, so it cannot be "
                    "updated in place. Pass fg.params(model) (detached) rather than "
                    "dict(model.named_parameters())."
                )
            key = t.untyped_storage().data_ptr()
            if t.numel() and key in seen:
                raise ValueError(
                    f"fg.make_step(donate=True): {path} shares memory with {seen[key]}. "
                    "Donated tensors are written in place, so they must not be views of "
                    "each other; clone one of them (or tie the weights in the module and "
                    "take fg.params(model), which lists a tied parameter once)."
                )
            seen[key] = path


class _Checks:
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
    ) -> None:
        self.tx, self.per_sample, self.donate = tx, per_sample, donate
        try:
            self.sig: inspect.Signature | None = inspect.signature(loss_fn)
        except (TypeError, ValueError):  # builtins and some C callables
            self.sig = None
        self.last: Any = None

    def __call__(self, params: Params, state: State, batch: tuple[Any, ...]) -> None:
        if self.per_sample is not None:  # shapes can change between calls: always check
            _check_batch(batch, "fg.make_step(per_sample=...)")
        flat, spec = optree.tree_flatten((params, state))  # type: ignore[arg-type,var-annotated]
        key = (spec, tuple(map(id, flat)) if self.donate else (), len(batch))
        if key == self.last:
            return
        if self.sig is not None:
            try:
                self.sig.bind(params, *batch)
            except TypeError as err:
                raise TypeError(
                    f"fg.make_step: loss_fn{self.sig} cannot be called with params and "
                    f"{len(batch)} batch argument(s): {err}. step(params, state, *batch) "
                    "passes *batch to loss_fn(params, *batch)."
                ) from None
        if self.per_sample is not None and tensor_paths(self.per_sample.init(_meta(params))):
            raise TypeError(
                "fg.make_step: per_sample must be stateless (its init returns no "
                "tensors), since it runs once per sample under vmap and nothing "
                "could carry its state from step to step. Put stateful "
                "transformations (Adam, add_noise, monitor) in tx instead."
            )
        if self.donate:
            _check_donation(params, state)
        try:  # run the transformation's own checks on shape-only tensors
            mp = _meta(params)
            self.tx.update(mp, _meta(state), mp)
        except NotImplementedError:
            pass
        self.last = key


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
            f"fg.make_step: tx must be a GradientTransformation (e.g. fg.adam()), got "
            f"{type(tx).__name__}."
        )
    if per_sample is not None and not isinstance(per_sample, GradientTransformation):
        raise TypeError(
            "fg.make_step: per_sample must be a stateless GradientTransformation, e.g. "
            f"fg.per_group(fg.rules.clip_norm(1.0), groups); got {type(per_sample).__name__}."
        )
    gradients = _gradients(loss_fn, has_aux, per_sample)
    checks = _Checks(loss_fn, tx, per_sample, donate)

    def step_impl(params: Params, state: State, *batch: Any) -> tuple[Any, ...]:
        grads, loss, aux = gradients(params, *batch)
        updates, new_state = tx.update(grads, state, params)
        new_params = apply_updates(params, updates)
        if donate:
            copy_into((params, state), (new_params, new_state))
            new_params, new_state = params, state
        out = (new_params, new_state, loss.detach())
        return (*out, aux) if has_aux else out

    if isinstance(compile, dict) or compile:
        options = compile if isinstance(compile, dict) else {}
        impl = torch.compile(step_impl, **{**options, "fullgraph": True})
    else:
        impl = step_impl

    def step(params: Params, state: State, *batch: Any) -> tuple[Any, ...]:
        checks(params, state, batch)
        try:
            return impl(params, state, *batch)
        except (RuntimeError, ValueError) as err:
            _raise_explained(err, per_sample=per_sample is not None)
            raise

    return step
