"""Clipping every gradient together: :func:`clip_by_global_norm`."""

from __future__ import annotations

from ..core._base import GradientTransformation, Params, shardable, stateless
from ..core._flat import Flat, by_buffer, from_buffers
from ..rules import _rule_base as _rb
from ..rules import clip_norm


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Rescale all gradients together so their joint 2-norm is at most ``max_norm``.

    The same formula as ``torch.nn.utils.clip_grad_norm_`` over every parameter
    (:func:`funcgrad.rules.clip_norm` with every parameter in one group). Used as
    ``per_sample=`` in :func:`funcgrad.make_step`, it clips each sample's whole
    gradient (DP-SGD).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.clip_by_global_norm(1.0)
        >>> tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, fg.EmptyState())[0]
        {'a': tensor([0.6000]), 'b': tensor([0.8000])}
    """
    rule = clip_norm(max_norm)

    def clip(grads: Params, params: Params | None) -> Params:
        if isinstance(grads, Flat) and _rb.shards() is None:  # the norm over the buffers
            return from_buffers(rule(by_buffer(grads)), grads.layout)  # type: ignore[return-value]
        return rule(grads)

    return shardable(stateless(clip), by_entry=True)
