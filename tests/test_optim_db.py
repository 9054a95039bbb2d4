"""PyTorch's own optimizer test matrix (``torch.testing._internal.common_optimizers``,
code nobody here wrote) run through funcgrad: every config torch lists for Adam, AdamW,
SGD, RMSprop, Adagrad, Adafactor, Muon, Adamax, RAdam, Adadelta, Rprop, NAdam, ASGD and LBFGS, in
float64 and float32, three ways:

- ``tx``: the functional transformation built with the config's keywords, ``tx.update``
  in a loop;
- ``Optimizer``: ``fg.Optimizer(params, fg.<name>(**config))``, the drop-in;
- ``group``: ``fg.Optimizer([{"params": params, **config}], fg.<name>())``, the config as a
  param group's keys over tx's defaults.

Each is compared with torch.optim run with the config as torch lists it (torch's
implementation flags ``foreach``/``fused``/``differentiable`` included: funcgrad drops
them, there is one implementation). Also torch's scheduler inputs (the drop-in under
torch's own schedulers) and torch's error inputs (funcgrad raises the same error type
with torch's message, or refuses where torch only warns)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import funcgrad as fg

common = pytest.importorskip(
    "torch.testing._internal.common_optimizers", reason="needs expecttest (the dev extra)"
)

TWINS = {
    "Adam": fg.adam,
    "AdamW": fg.adamw,
    "SGD": fg.sgd,
    "RMSprop": fg.rmsprop,
    "Adagrad": fg.adagrad,
    "Adafactor": fg.adafactor,
    "Muon": fg.muon,
    "Adamax": fg.adamax,
    "RAdam": fg.radam,
    "Adadelta": fg.adadelta,
    "Rprop": fg.rprop,
    "NAdam": fg.nadam,
    "ASGD": fg.asgd,
    "LBFGS": fg.lbfgs,
}
INFOS = {i.optim_cls.__name__: i for i in common.optim_db if i.optim_cls.__name__ in TWINS}
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
STEPS = 7
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}

# Rows where torch itself computes in float32 inside a float64 run, measured on this
# machine (docs/optimizers.md, "torch's own test matrix"): "differentiable" Adam/AdamW keep
# the bias corrections in the float32 step tensor, and Muon's "Tensor lr" is a float32
# tensor (torch.tensor(0.001)) multiplying float64 parameters. Compared at float32's
# tolerance, not skipped.
FLOAT32_IN_TORCH = {
    ("Adam", "differentiable"),
    ("AdamW", "differentiable"),
    ("Muon", "Tensor lr"),
    ("NAdam", "differentiable"),  # the coefficients from the float32 mu_product tensor
}


def configs() -> list[Any]:
    out = []
    for name, info in INFOS.items():
        for dtype in (torch.float64, torch.float32):
            for i, inp in enumerate(
                common._get_optim_inputs_including_global_cliquey_kwargs("cpu", dtype, info)
            ):
                tag = "f64" if dtype == torch.float64 else "f32"
                out.append(pytest.param(name, dtype, inp, id=f"{name}-{tag}-{i}-{inp.desc}"))
    return out


def make_params(name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"weight": (6, 4), "matrix": (3, 5)} if name == "Muon" else {}
    shapes = shapes or {"weight": (6, 4), "bias": (6,), "scale": (1,)}
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}


def grads_at(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


def objective(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """L-BFGS's loss (it evaluates the loss itself): smooth, not quadratic, so the line
    search has work to do; the same function of the parameters in every run."""
    total = torch.zeros((), dtype=next(iter(params.values())).dtype)
    for p in params.values():
        target = torch.linspace(-1.0, 1.0, p.numel(), dtype=p.dtype).view_as(p)
        total = total + ((p - target) ** 2).sum() + 0.1 * (p**4).sum()
    return total


def signed(maximize: bool) -> Any:
    """The objective to run: its negative where the config maximizes (torch 2.14's
    LBFGS ``maximize``), which is bounded above as the objective is bounded below."""
    return (lambda p: -objective(p)) if maximize else objective


def closure_loop(params: dict[str, torch.Tensor], opt: Any, schedulers: list[Any]) -> dict:
    f = signed(bool(opt.param_groups[0].get("maximize", False)))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = f(params)
        loss.backward()
        return loss

    for _ in range(STEPS):
        opt.step(closure)
        for s in schedulers:
            s.step(1.0) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) else s.step()
    return {k: p.detach() for k, p in params.items()}


def ours(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in IMPLEMENTATION}


def run_torch(name, start, kwargs, schedulers=()):
    # plain leaves (no requires_grad): torch's differentiable=True steps in grad mode,
    # where an in-place update of a Parameter is refused
    params = {k: v.clone() for k, v in start.items()}
    if name == "LBFGS":
        params = {k: v.requires_grad_() for k, v in params.items()}
    opt = INFOS[name].optim_cls(list(params.values()), **kwargs)
    loop = closure_loop if name == "LBFGS" else _loop
    return loop(params, opt, [s(opt) for s in schedulers])


def run_optimizer(name, start, kwargs, as_group, schedulers=()):
    params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    named = list(params.items())
    if as_group:
        opt = fg.Optimizer([{"params": named, **ours(kwargs)}], TWINS[name]())
    else:
        opt = fg.Optimizer(named, TWINS[name](**ours(kwargs)))
    loop = closure_loop if name == "LBFGS" else _loop
    return loop(params, opt, [s(opt) for s in schedulers])


def _loop(params, opt, schedulers):
    for i in range(STEPS):
        for k, p in params.items():
            p.grad = grads_at(params, i)[k]
        opt.step()
        for s in schedulers:
            # ReduceLROnPlateau's step takes a metric; the others take none
            s.step(1.0) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) else s.step()
    return {k: p.detach() for k, p in params.items()}


def run_tx(name, start, kwargs):
    tx = TWINS[name](**ours(kwargs))
    params = {k: v.clone() for k, v in start.items()}
    state = tx.init(params)
    if name == "LBFGS":  # fg.make_step gives it the loss function
        step = fg.make_step(signed(bool(kwargs.get("maximize", False))), tx)
        for _ in range(STEPS):
            params, state, _ = step(params, state)
        return params
    for i in range(STEPS):
        updates, state = tx.update(grads_at(params, i), state, params)
        params = fg.apply_updates(params, updates)
    return params


def tolerance(name: str, desc: str, dtype: torch.dtype) -> dict[str, float]:
    if any(name == n and d in desc for n, d in FLOAT32_IN_TORCH):
        return TOL[torch.float32]
    return TOL[dtype]


@pytest.mark.parametrize(("name", "dtype", "inp"), configs())
def test_torchs_config_matrix(name, dtype, inp):
    start = make_params(name, dtype)
    kwargs = dict(inp.kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on its own flags (e.g. fused)
        want = run_torch(name, start, kwargs)
    tol = tolerance(name, inp.desc, dtype)
    for how, got in (
        ("tx", run_tx(name, start, kwargs)),
        ("Optimizer", run_optimizer(name, start, kwargs, as_group=False)),
        ("group", run_optimizer(name, start, kwargs, as_group=True)),
    ):
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], **tol, msg=lambda m, h=how, k=k: f"{h} {k}: {m}"
            )
        assert any(not torch.equal(start[k], got[k]) for k in start), "nothing moved"


def scheduler_cases() -> list[Any]:
    out = []
    for name, info in INFOS.items():
        for i, scheds in enumerate(info.scheduler_inputs):
            out.append(pytest.param(name, scheds, id=f"{name}-{i}"))
    return out


@pytest.mark.parametrize(("name", "scheds"), scheduler_cases())
def test_torchs_scheduler_inputs(name, scheds):
    """torch's schedulers for each optimizer (StepLR, ReduceLROnPlateau, ...) write the
    drop-in's param groups; the run equals torch.optim's with the same schedulers."""
    start = make_params(name, torch.float64)
    kwargs = {"lr": 0.01}
    want = run_torch(name, start, kwargs, scheds)
    for as_group in (False, True):
        got = run_optimizer(name, start, kwargs, as_group, scheds)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL[torch.float64])


# torch's error inputs funcgrad does not share, each with why:
NOT_OURS = {
    # torch's implementation flags: funcgrad has one implementation, tensor hyperparameters
    # included.
    "lr as Tensor doesn't work with foreach & not capturable",
    "betas\\[0\\] as a Tensor is not supported for capturable=False and foreach=True",
    # funcgrad names unnamed parameters by position, so named and unnamed mix.
    "all optimizer params should be with/without names",
    "all optimizer param groups should be with/without names.",
    # torch's Muon refuses complex parameters at step; funcgrad's at construction
    # (checked below with its own message).
    "does not support complex parameters",
}


def error_cases() -> list[Any]:
    out = []
    for name, info in INFOS.items():
        for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            desc = e.optimizer_error_input.desc
            if desc in NOT_OURS:
                continue
            out.append(pytest.param(name, e, id=f"{name}-{desc[:40]}"))
    return out


@pytest.mark.parametrize(("name", "e"), error_cases())
def test_torchs_error_inputs(name, e):
    """torch's error inputs raise in funcgrad too, with torch's error type and message;
    a parameter listed twice in one group, which torch only warns about (and then
    steps twice), is refused."""
    inp = e.optimizer_error_input
    if isinstance(inp.params, list) and all(isinstance(p, torch.Tensor) for p in inp.params):
        # torch's inputs are plain tensors; funcgrad leaves a frozen (requires_grad=False)
        # parameter out, so they are made trainable to reach the check under test
        made = {id(p): p.detach().requires_grad_() for p in inp.params}  # twice stays twice
        inp.params = [made[id(p)] for p in inp.params]
    if e.error_type is UserWarning:  # duplicates in a group: funcgrad refuses them
        with pytest.raises(ValueError, match="listed twice"):
            fg.Optimizer(inp.params, TWINS[name](**ours(inp.kwargs)))
        return
    with pytest.raises(e.error_type, match=e.error_regex):
        fg.Optimizer(inp.params, TWINS[name](**ours(inp.kwargs)))
    if isinstance(inp.params, list) and inp.params and isinstance(inp.params[0], dict):
        return
    if inp.kwargs and isinstance(inp.params, list):  # the same keys as a group's
        with pytest.raises(e.error_type, match=e.error_regex):
            fg.Optimizer([{"params": inp.params, **ours(inp.kwargs)}], TWINS[name]())


def test_muon_refuses_complex_parameters_before_the_first_step():
    p = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises((TypeError, ValueError), match=re.escape("complex")):
        opt = fg.Optimizer([p], fg.muon())
        p.grad = torch.ones_like(p)
        opt.step()
