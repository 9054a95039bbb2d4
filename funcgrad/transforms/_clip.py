"""Clipping every gradient together: :func:`clip_by_global_norm`; per sample from
per-sample norms: :func:`ghost_clip`."""

from __future__ import annotations

from ..core._base import GradientTransformation, Params, shardable, stateless, with_facts
from ..core._flat import Flat, by_buffer, from_buffers
from ..core._shards import shards
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
        if isinstance(grads, Flat) and shards() is None:  # the norm over the buffers
            return from_buffers(rule(by_buffer(grads)), grads.layout)  # type: ignore[return-value]
        return rule(grads)

    return shardable(stateless(clip), by_entry=True)


def ghost_clip(max_norm: float, reduction: str = "mean") -> GradientTransformation:
    """Per-sample clipping for ``fg.make_step(..., per_sample=fg.ghost_clip(C))`` at the
    cost of one backward: the same result as ``per_sample=fg.clip_by_global_norm(C)``
    (every sample's gradient clipped to joint norm ``C``, then averaged), without
    forming per-sample gradients.

    Each sample's gradient norm comes from the inputs and output gradients of the
    modules that own the parameters (ghost clipping, Li et al. 2021), and the clipped
    sum from the same tensors (book-keeping, Bu et al. 2023): one forward, one
    backward to the modules' outputs, no per-sample gradient of a ``Linear``,
    ``Conv1d``/``Conv2d`` (``groups=1``, zero padding), ``Embedding`` (``padding_idx``
    honoured), ``LayerNorm``, ``GroupNorm`` or ``RMSNorm``. Any other module with
    parameters of its own gets them by a ``vmap`` over that module alone; tied weights
    and modules called twice get their per-sample gradients summed before the norm.

    What it needs of the loss (``make_step``'s ``loss_fn``): the batch's loss is the
    mean (``reduction="mean"``, torch's default) or the sum (``reduction="sum"``) of
    the samples' losses, with no mixing of samples (train-mode BatchNorm is refused);
    every parameter reached through the module that owns it (``fg.call``); every such
    module keeps the batch in its leading dimension. Anything else is a clear error
    naming what to use instead (``fg.clip_by_global_norm``). With ``has_aux``, the aux
    is the batch's, not stacked per sample. Privacy accounting is left to the user
    (Opacus's ``RDPAccountant``, Google's ``dp_accounting``).

    Outside ``per_sample=``, it is ``fg.clip_by_global_norm(max_norm)``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(3, 2)
        >>> def loss(p, x, y):
        ...     return torch.nn.functional.cross_entropy(fg.call(model, p, x), y)
        >>> tx = fg.chain(fg.add_noise(0.01, seed=0), fg.sgd(lr=0.1))
        >>> step = fg.make_step(loss, tx, per_sample=fg.ghost_clip(1.0))
        >>> params = fg.params(model)
        >>> params, state, l = step(params, tx.init(params), torch.randn(8, 3),
        ...                         torch.randint(0, 2, (8,)))
        >>> int(state.inner_states[1].count)
        1
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"fg.ghost_clip: reduction must be 'mean' or 'sum' (how the loss combines the "
            f"samples' losses), got {reduction!r}."
        )
    m = _rb.number(max_norm, "fg.ghost_clip: max_norm")
    if not m > 0:
        raise ValueError(f"fg.ghost_clip: max_norm must be > 0, got {m}.")
    return with_facts(clip_by_global_norm(m), ghost=(float(m), reduction))
