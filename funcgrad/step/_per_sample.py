"""Per-sample gradients: ``vmap(grad(loss))`` over the batch dimension.

:func:`vmapped_grads` is the one vmapped gradient function; ``fg.per_sample_grads``
returns its per-sample gradients, and ``fg.make_step(per_sample=...)`` applies a
transformation to each sample's gradients inside it before averaging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.func import grad_and_value, vmap

from ..core._base import GradientTransformation, LossFn, Params
from ..core._flat import Flat
from ..model._errors import explain_buffer_write, reraise


def check_batch(batch: tuple[Any, ...], who: str) -> int:
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


def vmapped_grads(
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


def per_sample_grads(loss_fn: LossFn, *, has_aux: bool = False) -> Callable[..., Any]:
    """Per-sample gradients: ``fn(params, *batch) -> {name: [B, *param.shape]}``.

    ``loss_fn(params, *batch) -> scalar`` is called on one sample at a time with
    its batch dimension restored as 1, so an ordinary mean-over-batch loss works
    unchanged. Built on ``vmap(grad(loss_fn))``: no Python loop over samples.
    With ``has_aux=True`` it returns ``(grads, aux)`` with aux batched.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(3, 1)
        >>> loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()
        >>> g = fg.per_sample_grads(loss)(fg.params(model), torch.randn(8, 3), torch.randn(8, 1))
        >>> g["weight"].shape
        torch.Size([8, 1, 3])
    """
    batched = vmapped_grads(loss_fn, has_aux)

    def fn(params: Params, *batch: Tensor) -> Any:
        if isinstance(params, Flat):  # per view: per-sample gradients keyed by name
            params = params.views()
        check_batch(batch, "fg.per_sample_grads")
        try:
            g, _, aux = batched(params, *batch)
        except (RuntimeError, ValueError) as err:
            reraise(err, explain_buffer_write(err, per_sample=True))
        return (g, aux) if has_aux else g

    return fn
