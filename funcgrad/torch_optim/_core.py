"""``fg.Optimizer``'s working part: :class:`Core` holds the transformation built for
the param groups, its state, and what each group's keys were, and runs a step (fused,
foreach or general path; L-BFGS's ``minimize``), writing the groups' values into the
optimizer states before it and the scheduled values back after it. The class the user
holds, its param-group bookkeeping and its ``state_dict`` live in
funcgrad/torch_optim/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._compat import compiling, tree_flatten
from ..core._base import GradientTransformation, Params, State, in_dtype_of
from ..core._combine import ParamGroupsState
from ..core._scratch import Scratch
from ..core._tree import tree_map
from ..core._vector import flat_vector, unflatten
from ..optim import _fused
from ..optim._get_set import get_hyperparams, optimizer_states, walk_states, with_optimizer_states
from ..optim._hparams import is_optimizer_state, is_schedule
from ..optim._param_groups import grouped, lr_ratios, optimizers_in

IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
"""torch.optim's implementation flags: accepted in a param group, they pick how torch
computes, never what; funcgrad computes the same either way."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return a is b


class Core:
    """What a step reads and writes. Kept off the ``torch.optim.Optimizer`` object: under
    ``torch.compile(opt.step)`` dynamo drops attribute writes on an optimizer (torch
    2.13), and the new state would be lost; on a plain object they are kept."""

    def __init__(self, owner: Any) -> None:  # the fg.Optimizer
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
        # the eager fused step's borrowed buffers (the rules' large results), this
        # optimizer's own: kept between steps, so no page of them faults again
        self.scratch = Scratch()
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
            if k not in self.takes or k in IMPLEMENTATION:
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
                if k in self.takes and k not in IMPLEMENTATION and not _same(v, shown.get(k))
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
            fused = _fused.run(self.fused, self.state, params, grads, self.scratch)
            if fused is not None:  # parameters and moments written in place
                self.state = fused
                self.pull(groups)
                return
        updates, state = self.full.update(grads, self.state, params)
        state = self.reduced(state)
        traced = compiling()  # torch.compile(opt.step)
        self.state = written_into(self.state, state, parameters) if traced else state
        us = [updates[n] for n in names]
        us = [in_dtype_of(u, p) for p, u in zip(parameters, us, strict=True)]
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


def written_into(old: State, new: State, parameters: list[Tensor]) -> State:
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


__all__ = ["IMPLEMENTATION", "Core", "carry", "written_into"]
