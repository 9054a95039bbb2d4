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

from ._compat import compiling, tree_flatten
from .core._base import GradientTransformation, Params, State, require_transformation
from .core._combine import ParamGroupsState
from .core._tree import tree_map
from .core._vector import flat_vector, unflatten
from .io._state_dict import load, state_dict
from .optim import _fused, _schedule_free
from .optim._hparams import (
    get_hyperparams,
    is_optimizer_state,
    is_schedule,
    optimizer_states,
    walk_states,
    with_optimizer_states,
)
from .optim._param_groups import grouped, lr_ratios, optimizers_in

_KEY = "funcgrad"
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
"""torch.optim's implementation flags: accepted in a param group, they pick how torch
computes, never what; funcgrad computes the same either way."""
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
        self._core: _Core | None = None
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
        self._core = _Core(self)

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


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return a is b


class _Core:
    """What a step reads and writes. Kept off the ``torch.optim.Optimizer`` object: under
    ``torch.compile(opt.step)`` dynamo drops attribute writes on an optimizer (torch
    2.13), and the new state would be lost; on a plain object they are kept."""

    def __init__(self, owner: Optimizer) -> None:
        self.owner = owner
        self.tx = owner.tx
        self.infos = optimizers_in(self.tx)
        self.ratios = lr_ratios(self.infos)
        self.takes = set(owner.defaults)
        self.dtensors = False
        self.scheduled = {
            k for info in self.infos for k, v in (info.kwargs or {}).items()
            if is_schedule(v) or (isinstance(v, tuple) and any(map(is_schedule, v)))
        }  # fmt: skip
        self.full: GradientTransformation = self.tx
        self.state: State = None
        self.fused: _fused.Plan | None = None
        self.regroup()

    # what the groups hold
    def names(self) -> list[str]:
        return [n for g in self.owner.param_groups for n in g["param_names"]]

    def params(self) -> Params:
        return {
            n: p.detach()
            for g in self.owner.param_groups
            for n, p in zip(g["param_names"], g["params"], strict=True)
        }

    def build(self, groups: list[dict[str, Any]]) -> GradientTransformation:
        """``fg.grouped(tx, groups)`` with each group's keys that differ from the defaults
        (a key left at its default keeps each optimizer's own value: two optimizers in
        ``tx`` may have other ``eps`` or ``weight_decay``); tensors always (the state
        holds the group's own)."""
        shown = getattr(self, "shown", [])
        defaults = self.owner.defaults

        def given(i: int, k: str, v: Any) -> bool:
            if k not in self.takes or k in _IMPLEMENTATION:
                return False
            if k in self.scheduled and i < len(shown) and _same(v, shown[i].get(k)):
                return False  # a schedule's value shown in the group: it keeps the schedule
            return isinstance(v, Tensor) or not _same(v, defaults.get(k))

        keys = [{k: v for k, v in g.items() if given(i, k, v)} for i, g in enumerate(groups)]
        if not self.infos:
            if len(groups) > 1 or any(
                not _same(v, self.owner.defaults[k]) for k, v in keys[0].items()
            ):
                raise TypeError(
                    "fg.Optimizer: tx holds no funcgrad optimizer (fg.adam, fg.sgd, ...) whose "
                    "hyperparameters param groups could set; use one param group."
                )
            return self.tx
        spec = [{"params": g["param_names"], **k} for g, k in zip(groups, keys, strict=True)]
        try:
            return grouped(self.tx, spec)
        except (TypeError, ValueError) as err:
            raise type(err)(f"fg.Optimizer: {err}") from None

    def regroup(self) -> None:
        """Build the transformation for the groups as they are, and its state: a fresh
        state for parameters new to it, the rest carried over."""
        groups = self.owner.param_groups
        if self.tx.facts.minimize is not None and len(groups) != 1:
            raise ValueError(
                "fg.Optimizer: fg.lbfgs doesn't support per-parameter options (parameter "
                "groups), as torch.optim.LBFGS: its iterations work on all parameters as "
                "one vector. Use one group."
            )
        full = self.build(groups)
        params = self.params()
        self.dtensors = any(hasattr(p, "placements") for p in params.values())  # FSDP2
        try:
            fresh = full.init(params)
        except KeyError as err:
            if self.owner._unnamed:
                raise KeyError(
                    f"fg.Optimizer: tx names parameters the optimizer does not know ({err}). "
                    "The parameters were given without names (model.parameters()), so they "
                    "are called '0', '1', ...: pass the model itself, fg.Optimizer(model, "
                    "tx), or model.named_parameters()."
                ) from None
            raise
        state = fresh if self.state is None else carry(self.state, fresh, self.scheduled)
        self.adopt(full, self.reduced(state), groups)

    def adopt(
        self, full: GradientTransformation, state: State, groups: list[dict[str, Any]]
    ) -> None:
        self.full, self.state = full, state
        self.fused = _fused.plan(full, state, [g["param_names"] for g in groups])
        # the hyperparameters each group's states hold (a key held by none, such as a
        # weight_decay the group was built with at 0.0, needs a rebuild to change)
        self.holds: list[set[str]] = [set() for _ in groups]

        def note(s: Any, i: int) -> Any:
            if i < len(self.holds):
                self.holds[i] |= set(s.hyperparams or {})
            return s

        walk_states(state, note, indexed=True)
        self.shown = [dict(g) for g in groups]
        self.built = [dict(g) for g in groups]
        self.pull(groups)

    def reduced(self, state: State) -> State:
        return tree_map(_reduced, state) if self.dtensors else state

    # the values the groups hold, into the state
    def sync(self, groups: list[dict[str, Any]]) -> None:
        if len(groups) != len(self.shown):  # torch.optim code appended a group itself
            raise ValueError(
                "fg.Optimizer: param_groups changed length outside add_param_group; add "
                "groups with opt.add_param_group({...})."
            )
        changed: list[dict[str, Any]] = []
        rebuild = False
        for i, (g, shown, built) in enumerate(zip(groups, self.shown, self.built, strict=True)):
            new = {
                k: v for k, v in g.items()
                if k in self.takes and k not in _IMPLEMENTATION and not _same(v, shown.get(k))
            }  # fmt: skip
            changed.append(new)
            rebuild = rebuild or any(
                self.structural(k, v, built.get(k)) or k not in self.holds[i]
                for k, v in new.items()
            )
        if not any(changed):
            return
        if rebuild:
            self.regroup()
            return
        for i, new in enumerate(changed):
            for k, v in new.items():
                self.push(i, k, v)
            self.shown[i].update(new)

    def structural(self, key: str, value: Any, built: Any) -> bool:
        """Whether a group's new value for ``key`` changes what its optimizers compute
        (not only a value in their states): another bool or option, a term turned on
        from zero, or a hyperparameter an optimizer holds no state for."""
        return any(
            key in (info.kwargs or {}) and key not in info.hyper and not _same(value, built)
            for info in self.infos
        )

    def push(self, group: int, key: str, value: Any) -> None:
        index = {"n": -1}
        ratios = self.ratios or [1.0]

        def write(s: Any, i: int) -> Any:
            if i != group or s.hyperparams is None or key not in s.hyperparams:
                return s
            index["n"] += 1
            ratio = ratios[index["n"] % len(ratios)] if key == "lr" else 1.0
            return s._replace(hyperparams={**s.hyperparams, key: _as_entry(value, ratio, s, key)})

        self.state = walk_states(self.state, write, indexed=True)

    def pull(self, groups: list[dict[str, Any]]) -> None:
        """Show each scheduled hyperparameter's next value in the groups."""
        if not self.scheduled:
            return
        states: dict[int, Any] = {}

        def first(s: Any, i: int) -> Any:
            states.setdefault(i, s)
            return s

        walk_states(self.state, first, indexed=True)
        for i, g in enumerate(groups):
            s = states.get(i)
            if s is None or s.hyperparams is None:
                continue
            for k in self.scheduled:
                if k in s.hyperparams and k in g:
                    value = get_hyperparams(s)[0][k]
                    g[k] = value
                    self.shown[i][k] = value

    def run(self, groups: list[dict[str, Any]]) -> None:
        self.sync(groups)
        self._check_frozen()
        parameters = [p for g in groups for p in g["params"]]
        names = [n for g in groups for n in g["param_names"]]
        grads = _grads(names, parameters)
        params = dict(zip(names, parameters, strict=True))
        if self.fused is not None and not self.dtensors:
            fused = _fused.run(self.fused, self.state, params, grads)
            if fused is not None:  # parameters and moments written in place
                self.state = fused
                self.pull(groups)
                return
        updates, state = self.full.update(grads, self.state, params)
        state = self.reduced(state)
        traced = compiling()  # torch.compile(opt.step)
        self.state = _written_into(self.state, state, parameters) if traced else state
        us = [updates[n] for n in names]
        us = [
            u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(parameters, us, strict=True)
        ]
        if traced:  # one add per tensor: inductor fuses each into its update's kernel
            for p, u in zip(parameters, us, strict=True):
                p.add_(u)
        else:
            torch._foreach_add_(parameters, us)
        self.pull(groups)

    def minimize(self, groups: list[dict[str, Any]], closure: Callable[[], Any]) -> Any:
        """One step of an optimizer that evaluates the loss itself (``fg.lbfgs``): each
        evaluation writes the point into the parameters and runs the closure."""
        self.sync(groups)
        self._check_frozen()
        parameters = [p for g in groups for p in g["params"]]
        names = [n for g in groups for n in g["param_names"]]

        def evaluate(x: Tensor) -> tuple[float, Tensor, Any]:
            at = unflatten(x, dict(zip(names, parameters, strict=True)))
            torch._foreach_copy_(parameters, [at[n] for n in names])
            with torch.enable_grad():
                loss = closure()
            grads = _grads(names, parameters)
            value = float(loss.detach() if isinstance(loss, Tensor) else loss)
            return value, torch.cat([grads[n].reshape(-1) for n in names]), loss

        (state,) = optimizer_states(self.state)
        x0 = flat_vector(dict(zip(names, parameters, strict=True)), "fg.Optimizer.step")
        minimize = self.full.facts.minimize
        assert minimize is not None
        x, state, first = minimize(evaluate, x0, state)
        at = unflatten(x, dict(zip(names, parameters, strict=True)))
        torch._foreach_copy_(parameters, [at[n] for n in names])
        self.state = with_optimizer_states(self.state, [state])
        self.pull(groups)
        return first

    def _check_frozen(self) -> None:
        for name, p in self.owner._frozen:
            if p.grad is not None:  # unfrozen since, or a .grad written by hand
                raise ValueError(
                    f"fg.Optimizer.step: '{name}' was frozen (requires_grad=False) when it was "
                    "given to the optimizer, which left it out, and has a gradient now. Add "
                    "it when you unfreeze it: opt.add_param_group({'params': [...]}) "
                    "(its optimizer state starts there, as in torch)."
                )


def _as_entry(value: Any, ratio: float, s: Any, key: str) -> Any:
    like = s.count
    if isinstance(value, (tuple, list)):
        old = s.hyperparams[key]
        return tuple(
            o if v is None else _scalar_entry(v, 1.0, like) for o, v in zip(old, value, strict=True)
        )
    return _scalar_entry(value, ratio, like)


def _scalar_entry(value: Any, ratio: float, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        t = value.detach().reshape(())
        return t if ratio == 1.0 else t * ratio
    return torch.tensor(float(value) * ratio, dtype=torch.float64, device=like.device)


def _written_into(old: State, new: State, parameters: list[Tensor]) -> State:
    """Traced (``torch.compile(opt.step)``): the new state's tensors copied into the old
    state's, which then stays the state, as the fused kernels update the moments in
    place. Inductor then writes each state buffer where it lies, in the kernel that
    computes it; a new state would be fresh buffers every step (on the 29.4M-parameter
    model, 3.4-7.8x torch's fused AdamW on the update over two runs). The new state as
    it is where that would not be the same values: its structure, shapes or dtypes
    changed, one old tensor sits at two places, or an old tensor is a parameter (none
    of funcgrad's optimizers do any of these)."""
    olds, old_spec = tree_flatten(old)
    news, new_spec = tree_flatten(new)
    if old_spec != new_spec:
        return new
    pairs = []
    for o, n in zip(olds, news, strict=True):
        if o is n:
            continue
        if not (
            isinstance(o, Tensor) and isinstance(n, Tensor)
            and o.shape == n.shape and o.dtype == n.dtype and o.device == n.device
        ):  # fmt: skip
            return new
        pairs.append((o, n))
    targets = {id(o) for o, _ in pairs}
    if len(targets) != len(pairs) or any(id(p) in targets for p in parameters):
        return new
    for o, n in pairs:
        o.copy_(n)
    return old


def _grads(names: list[str], parameters: list[Tensor]) -> Params:
    out: dict[str, Tensor] = {}
    for name, p in zip(names, parameters, strict=True):
        g = p.grad
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


def carry(old: Any, new: Any, scheduled: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    """``new`` (a fresh ``init``) with every part ``old`` also has taken from ``old``: the
    same optimizer states per group and per parameter name, rules' states, counters.
    A tensor whose shape or dtype differs stays new. Hyperparameters are the new ones
    (built from the groups' values as they are now), but for those ``tx`` gave as
    schedules (``scheduled``), whose values follow the step count."""
    if is_optimizer_state(new) and type(old) is type(new):
        hp = dict(new.hyperparams or {})
        for k in scheduled:
            if k in hp and k in (old.hyperparams or {}):
                hp[k] = old.hyperparams[k]
        fields = [carry(o, n, scheduled) for o, n in zip(old[:-1], new[:-1], strict=True)]
        return type(new)(*fields, hp)
    if isinstance(new, ParamGroupsState):
        olds = old.inner_states if isinstance(old, ParamGroupsState) else (old,)
        return ParamGroupsState(
            tuple(
                carry(olds[i], n, scheduled) if i < len(olds) else n
                for i, n in enumerate(new.inner_states)
            )
        )
    if isinstance(old, ParamGroupsState):
        return carry(old.inner_states[0], new, scheduled)
    if type(new) is dict and isinstance(old, Mapping):
        if hasattr(old, "views"):  # a Flat: by name
            old = dict(old.views())
        return {k: carry(old[k], v, scheduled) if k in old else v for k, v in new.items()}
    if isinstance(new, tuple) and type(old) is type(new):
        items = [carry(o, n, scheduled) for o, n in zip(old, new, strict=True)]
        return type(new)(*items) if hasattr(new, "_fields") else type(new)(items)
    if isinstance(new, list) and isinstance(old, list) and len(old) == len(new):
        return [carry(o, n, scheduled) for o, n in zip(old, new, strict=True)]
    if isinstance(new, Tensor) and isinstance(old, Tensor):
        same = old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
        return old if same else new
    return new


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


__all__ = ["Optimizer", "optimizer_states"]
