"""funcgrad's transformations as a ``torch.optim.Optimizer``: :class:`Optimizer`.

For loops and frameworks that already call ``loss.backward()`` and ``opt.step()``
(LR schedulers, ``torch.amp.GradScaler``, Lightning's ``configure_optimizers``, Hugging
Face ``Trainer(optimizers=...)``). ``step()`` reads the ``.grad`` of every trainable
parameter, runs ``tx.update`` on the named gradients (rules, ``monitor``, the
optimizer: what ``fg.make_step`` runs) and adds the updates to the parameters in place.

The learning rate: every optimizer inside ``tx`` keeps its learning rate in its own
state (``state.lr``: the float learning rate itself, or the factor of a schedule or a
0-d tensor; funcgrad/optim/_hparams.py), and ``tx`` holds none: one ``tx`` may serve any
number of ``fg.Optimizer`` s and ``fg.make_step`` s. ``fg.Optimizer`` has one param
group, whose ``"lr"`` starts at the first optimizer's learning rate; before each step
it writes ``group_lr * (own_lr / first_lr)`` into each optimizer's ``lr`` in *its own*
state (exactly ``group_lr`` for the first), so a torch scheduler that writes
``param_groups[0]["lr"]`` drives all of them, keeping their ratios. A 0-d tensor
learning rate in ``tx`` becomes the group's ``"lr"`` itself (schedulers edit it in
place, so ``torch.compile(opt.step)`` does not recompile). A funcgrad schedule inside
``tx`` keeps deciding: then the group's ``"lr"`` starts at 1.0 and multiplies it (a
torch scheduler scales the funcgrad schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .core import _flat as flat
from .core._base import GradientTransformation, Params, State, learning_rates
from .core._tree import tree_map
from .io._state_dict import load, state_dict
from .optim._hparams import optimizer_states, with_optimizer_states

_KEY = "funcgrad"


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs the funcgrad transformation ``tx``.

    Args:
        model_or_named_parameters: an ``nn.Module`` (its trainable parameters, in the
            flat layout of ``fg.params(model)``), or ``model.named_parameters()``
            (pairs ``(name, parameter)``; names are what rules and groups see).
        tx: the transformation, e.g. ``fg.chain(fg.per_group(rule, groups),
            fg.adamw(lr=1e-3))``.

    ``opt.tx_state`` is funcgrad's state (``opt.tx_state.inner_states[0]``,
    ``state["monitor"].stats`` for a named chain); ``state_dict()`` holds it as plain
    tensors (``torch.load(weights_only=True)``) beside the param group.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> groups = fg.group_by_module(model)
        >>> opt = fg.Optimizer(model, fg.chain(fg.per_group(fg.rules.zero_fix(), groups),
        ...                                    fg.adamw(lr=1e-2)))
        >>> sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
        >>> model(torch.ones(3, 2)).sum().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
        >>> int(opt.tx_state.inner_states[1].count), round(opt.param_groups[0]["lr"], 6)
        (1, 0.00625)
    """

    def __init__(
        self,
        model_or_named_parameters: nn.Module | Iterable[tuple[str, nn.Parameter]],
        tx: GradientTransformation,
    ) -> None:
        who = "fg.Optimizer"
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"{who}: tx must be a GradientTransformation (e.g. fg.adamw()), got "
                f"{type(tx).__name__}."
            )
        named = _named(model_or_named_parameters, who)
        self._core = _Core(tx, named)
        super().__init__([p for _, p in named], {"lr": self._core.start})

    @property
    def tx(self) -> GradientTransformation:
        """The transformation this optimizer runs."""
        return self._core.tx

    @property
    def tx_state(self) -> State:
        """funcgrad's state of ``tx`` (e.g. ``opt.tx_state["monitor"].stats``)."""
        return self._core.state

    # ---- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``tx`` on the parameters' ``.grad`` and update them in place.

        ``closure``, as in ``torch.optim.Adam``: called once, with gradients enabled,
        before the update (it zeroes the gradients, computes the loss, calls
        ``backward``); its return value is returned. PyTorch Lightning passes one.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        self._core.run(group["lr"], group["params"])
        return loss

    # ---- state
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state``, ``param_groups``) with funcgrad's state as plain
        nested tensors under ``"funcgrad"``: loadable with ``weights_only=True``."""
        sd = super().state_dict()
        sd[_KEY] = {"names": list(self._core.names), "state": state_dict(self.tx_state)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, checked in full before anything changes:
        another model's or transformation's state is an error that changes nothing."""
        self._commit(self._prepare(state_dict))

    def _prepare(self, state_dict: Any) -> tuple[State, dict[str, Any]]:
        """Check ``state_dict`` in full; the new funcgrad state and torch's part."""
        saved = state_dict.get(_KEY) if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, Mapping) or "state" not in saved:
            raise ValueError(
                "fg.Optimizer.load_state_dict: this state dict was not made by "
                "fg.Optimizer.state_dict() (it has no 'funcgrad' entry). A torch.optim "
                "optimizer's state converts with fg.state_from_torch."
            )
        names = self._core.names
        if list(saved.get("names", [])) != names:
            raise ValueError(
                "fg.Optimizer.load_state_dict: the state dict was saved for parameters "
                f"{list(saved.get('names', []))[:6]}..., not this optimizer's "
                f"{names[:6]}...; build the model and the optimizer as when saving."
            )
        new_state = load(self.tx, self._core.params, saved["state"], report_lr=False)
        torch_part = {k: v for k, v in state_dict.items() if k != _KEY}
        groups = torch_part.get("param_groups")
        if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
            len(g["params"]) for g in self.param_groups
        ]:
            raise ValueError(
                "fg.Optimizer.load_state_dict: the state dict's param groups do not match "
                "this optimizer's (one group of all trainable parameters)."
            )
        return new_state, torch_part

    def _commit(self, prepared: tuple[State, dict[str, Any]]) -> None:
        new_state, torch_part = prepared
        super().load_state_dict(torch_part)
        self._core.state = new_state

    def __repr__(self) -> str:
        return f"fg.Optimizer({len(self._core.names)} parameters, lr={self.param_groups[0]['lr']})"


class _Core:
    """What a step reads and writes. Kept off the ``torch.optim.Optimizer`` object: under
    ``torch.compile(opt.step)`` dynamo drops attribute writes on an optimizer (torch
    2.13), and the new state would be lost; on a plain object they are kept."""

    def __init__(self, tx: GradientTransformation, named: list[tuple[str, nn.Parameter]]) -> None:
        self.tx = tx
        self.names = [n for n, _ in named]
        # The state in the flat layout where the parameters allow it (a few buffers per
        # dtype, _flat.Layout.for_tensors: the elementwise optimizers then run over whole
        # buffers). The module is
        # left alone: each step reads the parameters themselves (the optimizer packs
        # them), because under torch.compile(opt.step) an in-place write to a tensor
        # that aliases a graph input is lost (torch 2.13, aot_autograd).
        data = {n: p.detach() for n, p in named}
        if all(flat._flattenable(p) for _, p in named):
            self.params: Params = flat.pack(data, flat.Layout.for_tensors(data))
        else:
            self.params = data
        self.dtensors = any(hasattr(p, "placements") for _, p in named)  # FSDP2
        self.state: State = self.reduced(tx.init(self.params))
        self.start, self._ratios, self._live = _group_lr(tx, self.state)

    def reduced(self, state: State) -> State:
        return tree_map(_reduced, state) if self.dtensors else state

    def _with_lr(self, lr: Any) -> State:
        """This optimizer's state with the group's ``lr`` written into each optimizer's
        ``lr`` field (``lr * ratio``; under a tensor first learning rate, the factor
        ``lr / that tensor``, which is 1.0 while the group's lr is the tensor itself)."""
        if not self._ratios:
            return self.state
        old = optimizer_states(self.state)
        if self._live is not None:
            scale: Any = 1.0 if lr is self._live else lr / self._live
        else:
            scale = lr
        new = []
        for s, ratio in zip(old, self._ratios, strict=True):
            value = scale * ratio if ratio != 1.0 else scale
            t = s.lr  # type: ignore[attr-defined]
            if isinstance(value, Tensor):
                value = value.detach().to(device=t.device, dtype=torch.float64).reshape(())
            else:
                value = torch.tensor(float(value), dtype=torch.float64, device=t.device)
            new.append(s._replace(lr=value))  # type: ignore[attr-defined]
        return with_optimizer_states(self.state, new)

    def run(self, lr: Any, parameters: list[Tensor]) -> None:
        # Read, never copied: under torch.compile(opt.step) a tensor written in place and
        # then read through another reference is read stale (torch 2.13). A tensor lr,
        # edited in place by a scheduler, compiles once; a float lr is a constant of the
        # graph (a new value recompiles, as in torch.optim).
        self.state = self._with_lr(lr)
        grads = self._grads([p.grad for p in parameters])
        params = dict(zip(self.names, parameters, strict=True))
        updates, state = self.tx.update(grads, self.state, params)
        self.state = self.reduced(state)
        us = [updates[n] for n in self.names]
        us = [
            u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(parameters, us, strict=True)
        ]
        torch._foreach_add_(parameters, us)

    def _grads(self, grads: list[Tensor | None]) -> Params:
        out: dict[str, Tensor] = {}
        for name, g in zip(self.names, grads, strict=True):
            if g is None:
                raise ValueError(
                    f"fg.Optimizer.step: '{name}' has no .grad (it took no part in the loss, "
                    "or zero_grad ran after backward). funcgrad updates all trainable "
                    "parameters as one state; freeze a parameter that is not trained "
                    "(p.requires_grad_(False)) before building the optimizer."
                )
            if g.is_sparse:
                raise TypeError(
                    f"fg.Optimizer.step: '{name}' has a sparse gradient; funcgrad's rules "
                    "and optimizers need dense ones (nn.Embedding(sparse=False))."
                )
            out[name] = g
        return out


def _named(
    source: nn.Module | Iterable[tuple[str, nn.Parameter]], who: str
) -> list[tuple[str, nn.Parameter]]:
    if isinstance(source, nn.Module):
        pairs = list(source.named_parameters())
    else:
        pairs = list(source)
        bad = [type(x).__name__ for x in pairs if not (isinstance(x, tuple) and len(x) == 2)]
        if bad:
            raise TypeError(
                f"{who}: expected an nn.Module or model.named_parameters() (pairs (name, "
                f"parameter)), got items of type {bad[0]}; rules and groups need names."
            )
    out = [(n, p) for n, p in pairs if p.requires_grad]
    if not out:
        raise ValueError(f"{who}: the model has no trainable parameters (requires_grad=True).")
    return out


def _group_lr(tx: GradientTransformation, state: State) -> tuple[Any, list[float], Any]:
    """The group's starting ``"lr"``, each optimizer's ratio to the first one's
    (``own_lr / first_lr``, read from ``tx.init``'s state: exactly 1.0 for the first),
    and the first optimizer's 0-d tensor learning rate if it has one (the group's lr is
    then that tensor, and the first optimizer's factor stays 1.0 while it is)."""
    own = [float(s.lr) for s in optimizer_states(state)]  # type: ignore[attr-defined]
    if not own:
        return 0.0, [], None
    built = learning_rates(tx)
    live = built[0] if len(built) == len(own) and isinstance(built[0], Tensor) else None
    base = own[0] or 1.0  # a first lr of 0: the others keep their own values
    ratios = [o / base for o in own]
    return (live if live is not None else own[0]), ratios, live


def _reduced(t: Any) -> Any:
    """A DTensor with a ``Partial`` placement (FSDP2: a statistic summed over the
    shards, such as ``monitor``'s zero fraction) as its reduced, replicated value:
    the value a user reads, and what ``torch.distributed.checkpoint`` saves (torch
    2.14 refuses partial placements). Other leaves unchanged."""
    placements = getattr(t, "placements", None)
    if placements is None or not any(p.is_partial() for p in placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in placements])
