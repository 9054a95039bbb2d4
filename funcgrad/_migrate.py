"""Moving Adam/AdamW state between ``torch.optim`` and funcgrad, both ways."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ._adam import AdamState


def _names_by_identity(
    optimizer: torch.optim.Optimizer, named_params: Mapping[str, Tensor], who: str
) -> list[tuple[str, Tensor]]:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"{who}: expected a torch.optim.Adam or AdamW, got {type(optimizer).__name__}; "
            "only Adam-family state maps onto fg.adam / fg.adamw."
        )
    by_id = {id(p): n for n, p in named_params.items()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise KeyError(
                    f"{who}: a parameter of shape {tuple(p.shape)} in the optimizer is not among "
                    "named_params. Pass dict(model.named_parameters()) of the model the "
                    "optimizer was built on (the same Parameter objects)."
                )
            out.append((by_id[id(p)], p))
    return out


def _amsgrad(optimizer: torch.optim.Optimizer, who: str) -> bool:
    flags = {bool(g["amsgrad"]) for g in optimizer.param_groups}
    if len(flags) > 1:
        raise ValueError(
            f"{who}: param groups disagree on amsgrad; funcgrad keeps one setting per tx."
        )
    return flags.pop()


def adam_state_from_torch(
    optimizer: torch.optim.Optimizer, named_params: Mapping[str, Tensor]
) -> AdamState:
    """The :class:`funcgrad.AdamState` equal to a ``torch.optim.Adam``/``AdamW`` state.

    Continue with ``fg.adam``/``fg.adamw`` built with the optimizer's hyperparameters
    (lr, betas, eps, weight_decay, amsgrad, maximize); the step counter, moments and
    (with amsgrad) max second moments are copied.

    Args:
        optimizer: the torch optimizer, possibly with no state yet (step 0).
        named_params: ``dict(model.named_parameters())``: the optimizer's parameters,
            matched by identity, give the names.

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> state = fg.adam_state_from_torch(opt, dict(model.named_parameters()))
        >>> int(state.count), sorted(state.mu)
        (1, ['bias', 'weight'])
    """
    who = "fg.adam_state_from_torch"
    pairs = _names_by_identity(optimizer, named_params, who)
    amsgrad = _amsgrad(optimizer, who)
    steps = {int(optimizer.state[p]["step"]) if p in optimizer.state else 0 for _, p in pairs}
    if len(steps) > 1:
        raise ValueError(
            f"{who}: the optimizer's parameters are at different steps {sorted(steps)}; funcgrad "
            "keeps one step counter per transformation. Convert after a step that updated "
            "every parameter, or use fg.partition with one adam per group of parameters."
        )
    count = steps.pop() if steps else 0
    mu, nu, nu_max = {}, {}, {}
    for name, p in pairs:
        st = optimizer.state.get(p, {})

        def take(key: str, st: dict = st, p: Tensor = p) -> Tensor:
            # No state yet (step 0): torch would start from zeros.
            return st[key].detach().clone() if st else torch.zeros_like(p).detach()

        mu[name], nu[name] = take("exp_avg"), take("exp_avg_sq")
        if amsgrad:
            nu_max[name] = take("max_exp_avg_sq")
    device = pairs[0][1].device if pairs else torch.device("cpu")
    return AdamState(torch.tensor(count, dtype=torch.int64, device=device), mu, nu, nu_max)


def adam_state_to_torch(
    state: AdamState, optimizer: torch.optim.Optimizer, named_params: Mapping[str, Tensor]
) -> None:
    """Write a funcgrad :class:`AdamState` into ``optimizer.state`` (the reverse).

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> tx = fg.adam()
        >>> state = tx.init(fg.params(model))
        >>> opt = torch.optim.Adam(model.parameters())
        >>> fg.adam_state_to_torch(state, opt, dict(model.named_parameters()))
        >>> float(opt.state[model.weight]["step"])
        0.0
    """
    who = "fg.adam_state_to_torch"
    if not isinstance(state, AdamState):
        raise TypeError(f"{who}: expected an fg.AdamState, got {type(state).__name__}.")
    pairs = _names_by_identity(optimizer, named_params, who)
    amsgrad = _amsgrad(optimizer, who)
    if amsgrad != bool(state.nu_max):
        raise ValueError(
            f"{who}: the optimizer has amsgrad={amsgrad} but the state was made with "
            f"amsgrad={bool(state.nu_max)}; build both with the same setting."
        )
    missing = sorted(n for n, _ in pairs if n not in state.mu)
    if missing:
        raise KeyError(f"{who}: the state has no entries for the optimizer's parameters {missing}.")
    for name, p in pairs:
        # torch.optim keeps "step" as a float32 CPU tensor unless capturable/fused.
        entry = {
            "step": torch.tensor(float(state.count), dtype=torch.float32),
            "exp_avg": state.mu[name].detach().clone(),
            "exp_avg_sq": state.nu[name].detach().clone(),
        }
        if amsgrad:
            entry["max_exp_avg_sq"] = state.nu_max[name].detach().clone()
        optimizer.state[p] = entry
