"""The published tensor-hook answer to the seed question, re-implemented.

Kept only to show, side by side, why it is wrong (examples/seed_rule.py, the demo)
and what it costs (benchmarks/). Do not use it: tensor hooks fire before ``.grad``
is written, so the layer-level decision reads ``None``, zeros or a half-written
layer. For code that keeps ``torch.optim``, use a post-accumulate-grad hook instead.
"""

from __future__ import annotations

import torch
from torch import nn


def attach_hook_answer(
    model: nn.Module, types: tuple[type[nn.Module], ...] = (nn.Linear,)
) -> list[torch.utils.hooks.RemovableHandle]:
    """Register, on every parameter of every layer of ``types``, a tensor hook that
    decides for the whole layer by reading the layer's ``.grad`` at hook time."""

    def layer_hook(layer: nn.Module):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            seen = [p.grad.flatten() for p in layer.parameters() if p.grad is not None]
            if not seen:
                return grad  # nothing written yet: the rule is skipped entirely
            if bool((torch.cat(seen) == 0).all()):
                return torch.ones_like(grad)
            return torch.where(grad == 0, torch.tensor(0.5), grad)

        return hook

    handles = []
    for layer in model.modules():
        if isinstance(layer, types):
            for p in layer.parameters(recurse=False):
                handles.append(p.register_hook(layer_hook(layer)))
    return handles
