"""A bridge for code that keeps ``torch.optim``: the same rules, applied to ``.grad``.

The published hook answer used ``Tensor.register_hook``, which fires *before* a
parameter's ``.grad`` is written, so a layer-level decision read ``None``, zeros or
a half-written layer. :func:`attach` instead waits until the backward pass has
finished accumulating every gradient: the first
``register_post_accumulate_grad_hook`` to fire in a backward pass queues one
callback on the autograd engine, which runs when the pass is over and applies the
rule to each group's ``.grad`` in place.

Semantics, chosen to equal the functional path (``torch.func.grad`` + ``fg.per_group``):

- the rule sees each group's gradients as accumulated by this backward pass (with
  ``zero_grad()`` before it, the current step's gradients);
- a parameter that received no gradient in the pass counts as a zero gradient
  (``torch.func.grad`` returns zeros for it): its ``.grad`` is created or, after
  ``zero_grad(set_to_none=False)``, already zero, and the rule applies to it;
- groups whose parameters all went unused are finalized too, as long as some
  parameter of the model received a gradient in that pass;
- with gradient accumulation over several backward passes, the rule runs at the
  end of each pass on the accumulated ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _compat
from .rules._groups import Groups, as_groups
from .rules._rule_base import apply_rule, check_is_rule

__all__ = ["RuleHandle", "attach"]


class RuleHandle:
    """Returned by :func:`attach`; ``remove()`` detaches every hook."""

    def __init__(self, handles: list[torch.utils.hooks.RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RuleHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach(
    model: nn.Module,
    rule: Callable[[dict[str, Tensor]], Mapping[str, Tensor]],
    groups: Groups | Mapping[str, Sequence[str]],
    scaler: Any = None,
) -> RuleHandle:
    """Apply ``rule`` to each group's ``.grad`` at the end of every backward pass.

    With ``scaler`` (a ``torch.amp.GradScaler``), ``.grad`` holds gradients multiplied
    by the scaler's current scale. The rule then acts in the loss's own units: each
    group is divided by the scale, the rule applied, and the result multiplied back,
    so ``scaler.unscale_`` / ``scaler.step`` see exactly what the rule made of the
    true gradient (an all-zero layer becomes 1.0, not 1.0 / scale). The scale is
    read as a device tensor: no host sync.

    Examples:
        >>> import torch, funcgrad as fg
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> _ = model[0].bias.data.fill_(-10.0)  # dead ReLUs: layer 0 gets all-zero grads
        >>> handle = fg.hooks.attach(model, fg.rules.zero_fix(), fg.group_by_module(model))
        >>> model(torch.rand(3, 1)).sum().backward()
        >>> model[0].bias.grad
        tensor([1., 1.])
        >>> handle.remove()
    """
    check_is_rule(rule, "fg.hooks.attach: rule")
    if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale")):
        raise TypeError(
            f"fg.hooks.attach: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}."
        )
    groups = as_groups(groups)
    named = dict(model.named_parameters())
    groups.check_against(named, "fg.hooks.attach")
    members = [named[n] for names in groups.values() for n in names]
    pending = [False]

    def finalize() -> None:
        pending[0] = False
        scale = _compat.grad_scaler_scale(scaler) if scaler is not None else None
        with torch.no_grad():
            for names in groups.values():
                group: dict[str, Tensor] = {}
                for n in names:
                    p = named[n]
                    g = p.grad
                    if g is None:  # unused in this pass: a zero gradient
                        g = p.grad = torch.zeros_like(p)
                    group[n] = g
                if scale is None:
                    new = apply_rule(rule, group)
                else:  # in the loss's own units, then scaled back
                    true = {n: g / scale for n, g in group.items()}
                    new = {n: v * scale for n, v in apply_rule(rule, true).items()}
                for n, g in group.items():
                    g.copy_(new[n])

    def on_accumulated(param: Tensor) -> None:
        if not pending[0]:
            pending[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(finalize)

    handles = [p.register_post_accumulate_grad_hook(on_accumulated) for p in members]
    return RuleHandle(handles)
