"""funcgrad's transformations as a ``torch.optim.Optimizer``: :class:`Optimizer`.

For loops and frameworks that already call ``loss.backward()`` and ``opt.step()``
(LR schedulers, ``torch.amp.GradScaler``, Lightning's ``configure_optimizers``, Hugging
Face ``Trainer``). ``step()`` reads the ``.grad`` of every parameter, runs ``tx.update``
on the named gradients (rules, ``monitor``, the optimizer: what ``fg.make_step`` runs)
and adds the updates to the parameters in place.

Param groups are torch's: each group's keys override the hyperparameters ``tx``'s
optimizers were built with, for the group's parameters (``fg.grouped`` builds one
copy of each optimizer per group). Every hyperparameter lives in the optimizer
states (funcgrad/optim/_hparams.py); before each step the values a scheduler or the
user wrote into ``param_groups`` since the last step are written into the states of
their group (``lr`` keeping each optimizer's ratio to the first one's); a key whose
new value changes the update's structure (``amsgrad``, ``nesterov``, a
``weight_decay`` or ``momentum`` turned on from zero) rebuilds that group's optimizer,
its state carried over. After a step, a hyperparameter given to ``tx`` as a schedule
shows its next value in the group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core._base import GradientTransformation, State, require_transformation
from ..io._state_dict import load, state_dict
from ..optim import _schedule_free
from ..optim._get_set import get_hyperparams, optimizer_states
from ..optim._param_groups import optimizers_in
from ._core import Core

_KEY = "funcgrad"
_KNOWN = {
    "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening",
    "nesterov", "alpha", "centered", "lr_decay", "initial_accumulator_value",
    "beta2_decay", "d", "ns_coefficients", "ns_steps", "adjust_lr_fn", "b1", "b2", "rho",
    "lambd", "t0", "etas", "step_sizes", "momentum_decay", "decoupled_weight_decay",
    "max_iter", "max_eval", "tolerance_grad", "tolerance_change", "history_size",
    "line_search_fn", "mask", "eps_root", "warmup_steps", "r", "weight_lr_power",
}  # fmt: skip
"""Hyperparameter names of torch.optim's and funcgrad's optimizers: a group key among
these that no optimizer in ``tx`` takes is an error (it would be ignored); any other
key is the user's own, kept in the group as torch keeps it."""


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs the funcgrad transformation ``tx``.

    Args:
        params: what ``torch.optim`` takes: an ``nn.Module`` (its trainable
            parameters, named as in ``named_parameters()``), ``model.named_parameters()``,
            ``model.parameters()``, or a list of param-group dicts whose ``"params"``
            hold parameters or ``(name, parameter)`` pairs and whose other keys
            override ``tx``'s hyperparameters for the group (``lr``, ``betas``,
            ``weight_decay``, ``momentum``, ``nesterov``, ``amsgrad``...).
        tx: the transformation, e.g. ``fg.chain(fg.per_group(rule, groups),
            fg.adamw(lr=1e-3))``; its optimizers' arguments are the groups' defaults.

    Names: rules and groups see each parameter by name. A parameter given without one
    is named by its index in the optimizer (``"0"``, ``"1"``, ... across the groups in
    order, as ``state_dict()`` numbers them), or by its name in the module when the
    optimizer was built from one (``add_param_group`` of a module's parameters). A
    ``tx`` whose rules name parameters (``fg.group_by_module(model)``) needs the names:
    pass the model or ``named_parameters()``.

    Parameters with ``requires_grad=False`` when given are left out (they are not
    trained); to train them later, unfreeze them and ``add_param_group`` them
    (progressive unfreezing), as their state starts there. A parameter listed twice is
    an error.

    ``param_groups[i]`` shows every hyperparameter of its group; writing one takes
    effect at the next step. ``opt.tx_state`` is funcgrad's state (one optimizer state
    per group when there are several: ``fg.get_hyperparams(opt.tx_state)``);
    ``state_dict()`` holds it as plain tensors (``torch.load(weights_only=True)``)
    beside the param groups.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = fg.Optimizer(
        ...     [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
        ...     fg.adamw(lr=1e-2, weight_decay=0.1),
        ... )
        >>> sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        >>> model(torch.ones(3, 2)).sum().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
        >>> [round(g["betas"][0], 4) for g in opt.param_groups]  # OneCycleLR cycles beta1
        [0.9, 0.9]
        >>> [h.get("weight_decay") for h in fg.get_hyperparams(opt.tx_state)]  # 0.0: built off
        [0.1, None]
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        tx: GradientTransformation,
    ) -> None:
        who = "fg.Optimizer"
        require_transformation(tx, f"{who}: tx", "fg.adamw()")
        self._tx = tx
        self._core: Core | None = None
        self._names: set[str] = set()
        self._unnamed = False
        self._frozen: list[tuple[str, Tensor]] = []
        self._module: dict[int, str] = {}
        self._training = False  # schedule-free optimizers only: opt.train() / opt.eval()
        if isinstance(params, nn.Module):
            self._module = {id(p): n for n, p in params.named_parameters()}
            named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
            if not named:
                raise ValueError(
                    f"{who}: the model has no trainable parameters (requires_grad=True)."
                )
            params = [{"params": named}]
        defaults = _defaults(tx)
        super().__init__(params, defaults)  # type: ignore[arg-type]
        self._core = Core(self)

    @property
    def tx(self) -> GradientTransformation:
        """The transformation this optimizer runs (as given: without the param groups;
        ``opt.grouped_tx`` is the one that runs)."""
        return self._tx

    @property
    def grouped_tx(self) -> GradientTransformation:
        """``fg.grouped(tx, param groups)``: the transformation each step runs."""
        assert self._core is not None
        return self._core.full

    @property
    def tx_state(self) -> State:
        """funcgrad's state (e.g. ``opt.tx_state["monitor"].stats``), holding the param
        groups' values as the next step will use them."""
        assert self._core is not None
        self._core.sync(self.param_groups)
        return self._core.state

    # ---- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim``'s: keys it does not give take the
        optimizer's defaults (``tx``'s arguments); its parameters start with a fresh
        state (step 0) while the others go on, as in torch. Progressive unfreezing:
        ``opt.add_param_group({"params": model.backbone.parameters(), "lr": 1e-4})``."""
        who = "fg.Optimizer.add_param_group"
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        group = dict(param_group)
        if "params" not in group:
            raise KeyError(f"{who}: a param group needs 'params'.")
        pairs = self._pairs(group["params"], len(self.param_groups))
        self._check_keys(group)
        group["params"] = [p for _, p in pairs]
        group["param_names"] = [n for n, _ in pairs]
        if not pairs:
            raise ValueError(
                f"{who}: param group {len(self.param_groups)} has no trainable parameters "
                "(requires_grad=True)."
            )
        super().add_param_group(group)
        self._names.update(n for n, _ in pairs)
        param_group.update(self.param_groups[-1])
        if self._core is not None:  # after construction: the new group joins the state
            self._core.regroup()

    def _pairs(self, params: Any, index: int) -> list[tuple[str, Tensor]]:
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but "
                "the ordering of tensors in sets will change between runs. Please use a "
                "list instead."
            )
        items = list(params.named_parameters() if isinstance(params, nn.Module) else params)
        pairs: list[tuple[str, Tensor]] = []
        seen: dict[int, str] = {}
        taken = sum(len(g["params"]) for g in self.param_groups)
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name, p = item
            elif isinstance(item, Tensor):
                p = item
                name = self._module.get(id(p), "")
                if not name:
                    name, self._unnamed = str(taken + len(pairs)), True
            else:
                raise TypeError(
                    "fg.Optimizer: params hold parameters, (name, parameter) pairs or "
                    f"param-group dicts; got {type(item).__name__} in group {index}."
                )
            if not isinstance(p, Tensor):
                raise TypeError(
                    "optimizer can only optimize Tensors, but one of the params is "
                    + torch.typename(p)
                )
            if id(p) in seen:
                raise ValueError(
                    f"fg.Optimizer: a parameter is listed twice in param group {index} (as "
                    f"'{seen[id(p)]}' and '{name}'); list each parameter once (torch.optim "
                    "deprecates this: it would step the parameter twice)."
                )
            seen[id(p)] = name
            if not p.requires_grad:
                self._frozen.append((name, p))
                continue
            if name in self._names or any(name == n for n, _ in pairs):
                raise ValueError(
                    f"fg.Optimizer: two parameters are named '{name}'; names must be unique "
                    "across the param groups (they name the state)."
                )
            pairs.append((name, p))
        return pairs

    def _check_keys(self, group: Mapping[str, Any]) -> None:
        takes = set(self.defaults)
        wrong = sorted(k for k in group if k in _KNOWN and k not in takes)
        if wrong:
            raise KeyError(
                f"fg.Optimizer: param group key(s) {wrong} are hyperparameters no optimizer "
                f"in tx takes (its hyperparameters: {sorted(takes)}); they would be ignored. "
                "Build tx with an optimizer that has them, or drop the key(s)."
            )

    # ---- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``tx`` on the parameters' ``.grad`` and update them in place.

        ``closure``, as in ``torch.optim.Adam``: called once, with gradients enabled,
        before the update (it zeroes the gradients, computes the loss, calls
        ``backward``); its return value is returned. PyTorch Lightning passes one.
        """
        assert self._core is not None
        if not self._training and _schedule_free.holds_schedule_free(self._core.state):
            raise RuntimeError(
                "fg.Optimizer.step: a schedule-free optimizer is in eval mode (the "
                "parameters hold the evaluation point). Call opt.train() before training, "
                "the first step included, and opt.eval() before evaluating or saving, as "
                "schedulefree's optimizers require."
            )
        if self._core.full.facts.minimize is not None:  # fg.lbfgs
            if closure is None:
                raise TypeError(
                    "fg.Optimizer.step: fg.lbfgs evaluates the loss several times a step: "
                    "pass a closure that zeroes the gradients, computes the loss, calls "
                    "backward() and returns the loss, as torch.optim.LBFGS.step(closure)."
                )
            return self._core.minimize(self.param_groups, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._core.run(self.param_groups)
        return loss

    # ---- schedule-free modes
    def train(self) -> None:
        """Training mode: a schedule-free optimizer's parameters (``fg.schedule_free_adamw``,
        ``fg.schedule_free_sgd``) move back to the training point, in place, as
        schedulefree's ``opt.train()``. Call it before training; for other optimizers
        it changes nothing (Hugging Face ``Trainer`` calls it on every optimizer)."""
        assert self._core is not None
        if not self._training:
            _schedule_free.move(self._core.state, self._core.params(), to_eval=False)
        self._training = True

    def eval(self) -> None:
        """Evaluation mode: a schedule-free optimizer's parameters move to the evaluation
        point (the average), in place, as schedulefree's ``opt.eval()``; call it before
        evaluating or saving the model, and :meth:`train` to go on training. For other
        optimizers it changes nothing."""
        assert self._core is not None
        if self._training:
            _schedule_free.move(self._core.state, self._core.params(), to_eval=True)
        self._training = False

    # ---- state
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state``, ``param_groups``) with funcgrad's state as plain
        nested tensors under ``"funcgrad"``: loadable with ``weights_only=True``."""
        assert self._core is not None
        self._core.sync(self.param_groups)
        sd = super().state_dict()
        sd[_KEY] = {
            "names": self._core.names(),
            "state": state_dict(self.tx_state),
            "train_mode": self._training,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, checked in full before anything changes:
        another model's or transformation's state is an error that changes nothing."""
        self._commit(self._prepare(state_dict))
        self._training = bool(state_dict[_KEY].get("train_mode", self._training))

    def _prepare(self, state_dict: Any) -> tuple[Any, ...]:
        """Check ``state_dict`` in full, changing nothing; what :meth:`_commit` adopts."""
        assert self._core is not None
        saved = state_dict.get(_KEY) if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, Mapping) or "state" not in saved:
            raise ValueError(
                "fg.Optimizer.load_state_dict: this state dict was not made by "
                "fg.Optimizer.state_dict() (it has no 'funcgrad' entry). A torch.optim "
                "optimizer's state converts with fg.state_from_torch."
            )
        names = self._core.names()
        if list(saved.get("names", [])) != names:
            raise ValueError(
                "fg.Optimizer.load_state_dict: the state dict was saved for parameters "
                f"{list(saved.get('names', []))[:6]}..., not this optimizer's "
                f"{names[:6]}...; build the model and the optimizer as when saving."
            )
        torch_part = {k: v for k, v in state_dict.items() if k != _KEY}
        groups = torch_part.get("param_groups")
        if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
            len(g["params"]) for g in self.param_groups
        ]:
            raise ValueError(
                "fg.Optimizer.load_state_dict: the state dict's param groups do not match "
                "this optimizer's (their number and sizes); build it as when saving."
            )
        # The saved groups' values (a checkpoint from before every hyperparameter was
        # state holds only lr): the structure to load into, then the state itself.
        values = [
            {**g, **{k: v for k, v in saved_g.items() if k in g and k != "params"}}
            for g, saved_g in zip(self.param_groups, groups, strict=True)
        ]
        full = self._core.build(values)
        new_state = load(full, self._core.params(), saved["state"], report_lr=False)
        return full, new_state, torch_part

    def _commit(self, prepared: tuple[Any, ...]) -> None:
        assert self._core is not None
        full, new_state, torch_part = prepared
        super().load_state_dict(torch_part)
        self._core.adopt(full, new_state, self.param_groups)

    def __repr__(self) -> str:
        assert self._core is not None
        lrs = [g["lr"] for g in self.param_groups if "lr" in g]
        return f"fg.Optimizer({len(self._core.names())} parameters, lr={lrs})"


def _defaults(tx: GradientTransformation) -> dict[str, Any]:
    """The param groups' defaults: every argument of every optimizer in ``tx`` (the
    first one's value where two share a name), a tensor cloned (each optimizer keeps
    its own, as ``tx`` may serve several)."""
    out: dict[str, Any] = {}
    for info in optimizers_in(tx):
        for k, v in (info.kwargs or {}).items():
            if k not in out:
                out[k] = v.detach().clone() if isinstance(v, Tensor) else v
    if not out:  # a transformation built by hand: the hyperparameters its state holds
        try:
            held = get_hyperparams(tx.init({}))
        except Exception:
            held = []
        for h in held:
            for k, v in h.items():
                out.setdefault(k, v)
    return out


__all__ = ["Optimizer", "optimizer_states"]
