"""Each of torch's private names funcgrad uses (funcgrad/_compat.py), exercised on the
installed torch: a release that drops or changes one fails here, by name."""

from __future__ import annotations

import sys

import pytest
import torch

from funcgrad import _compat


def test_pytree_maps_and_registers():
    tree = {"a": torch.ones(2), "b": (torch.zeros(1), 3)}
    out = _compat.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, tree)
    assert torch.equal(out["a"], torch.full((2,), 2.0)) and out["b"][1] == 3
    only = _compat.tree_map_only(torch.Tensor, lambda x: x + 1, tree)
    assert torch.equal(only["b"][0], torch.ones(1)) and only["b"][1] == 3

    class Box:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    _compat.register_pytree_node(Box, lambda b: ([b.x], None), lambda children, _: Box(children[0]))
    boxed = _compat.tree_map(lambda x: x + 1, Box(torch.zeros(1)))
    assert isinstance(boxed, Box) and boxed.x.item() == 1.0
    # flatten / unflatten: None and numbers are leaves too
    leaves, spec = _compat.tree_flatten(((torch.ones(1), None), {"k": 2}))
    assert len(leaves) == 3 and leaves[1] is None and leaves[2] == 2
    back = _compat.tree_unflatten([torch.zeros(1), None, 5], spec)
    assert back[0][1] is None and back[1] == {"k": 5} and torch.equal(back[0][0], torch.zeros(1))


def test_functorch_interpreter_stack_and_wrappers():
    seen: list[tuple[bool, bool]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append((_compat.functorch_transform_active(), _compat.is_functorch_wrapped(x)))
        return (x * x).sum()

    assert not _compat.functorch_transform_active()
    assert not _compat.is_functorch_wrapped(torch.ones(1))
    torch.func.grad(f)(torch.ones(3))
    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == [(True, True), (True, True)]


def test_distributed_nn_is_imported_with_funcgrad_so_its_defaults_hold_no_group():
    """torch.distributed.nn.functional evaluates ``group=group.WORLD`` when imported;
    funcgrad imports it first (before any process group), so those defaults are None
    and do not keep a destroyed world group alive (docs/compile-notes.md, "Torch bugs,
    with their repros")."""
    import torch.distributed.nn.functional as dnf

    _compat.import_distributed_nn_early()
    assert "torch.distributed.nn.functional" in sys.modules
    defaults = [d for f in (dnf.all_reduce, dnf.broadcast) for d in f.__defaults__ or ()]
    assert None in defaults
    assert not any(isinstance(d, torch.distributed.ProcessGroup) for d in defaults)


def test_functional_collectives_is_imported_on_first_use():
    fc = _compat.functional_collectives()
    assert fc.__name__ == "torch.distributed._functional_collectives"
    assert fc is sys.modules["torch.distributed._functional_collectives"]
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        assert callable(getattr(fc, name)), name


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_inductor_mode_options(mode):
    options = _compat.inductor_mode_options(mode)
    assert isinstance(options, dict)
    if mode != "default":
        assert options.get("max_autotune") is True


def test_grad_scaler_scale():
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert _compat.grad_scaler_scale(disabled) is None
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    scale = _compat.grad_scaler_scale(scaler)
    assert float(scale) == scaler.get_scale() == 8.0
    # the private method itself, where torch has it, gives a tensor (no host sync)
    assert isinstance(scaler._get_scale_async(), torch.Tensor)


def test_compiling_is_dynamo_tracing_in_this_thread():
    def f(x):
        return x + (1.0 if _compat.compiling() else 0.0)

    assert not _compat.compiling()
    assert float(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(()))) == 1.0
    assert float(f(torch.zeros(()))) == 0.0


def test_compile_without_running_compiles_and_runs_later():
    """torch.compile(...).aot_compile: nothing runs at build time (the input is not
    written), the result runs the graph, guard_check tells inputs that do not fit."""

    def fn(x: torch.Tensor, scale: float) -> torch.Tensor:
        x.add_(1.0)
        return (x * scale).sum()

    x = torch.zeros(3)
    built = _compat.compile_without_running(fn, {"backend": "aot_eager"}, (x, 2.0))
    assert torch.equal(x, torch.zeros(3))  # not run
    assert built.guard_check(x, 2.0) and not built.guard_check(torch.zeros(4, 2), 2.0)
    assert built(x, 2.0).item() == 6.0 and torch.equal(x, torch.ones(3))


def test_compile_without_running_a_step_that_restarts_torchs_analysis():
    """A donated fg.sgd step: aot_compile alone raises TensorifyScalarRestartAnalysis
    on it (torch 2.13, a fresh process); compile_without_running calls again and
    builds it, equal to the eager step."""
    import funcgrad as fg
    from funcgrad.step._step import _core, _traced_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    core = _core(
        lambda p, x: fg.call(model, p, x).square().sum(), fg.sgd(lr=0.1), False, None, True, False
    )
    x = torch.randn(4, 3, dtype=torch.float64)
    want = {
        k: v.detach() - 0.1 * g
        for (k, v), g in zip(
            model.named_parameters(),
            torch.autograd.grad(model(x).square().sum(), list(model.parameters())),
            strict=True,
        )
    }
    params = fg.params(model)
    state = fg.sgd(lr=0.1).init(params)
    built = _compat.compile_without_running(
        _traced_step(core), {"backend": "aot_eager"}, (params, state, x)
    )
    built(params, state, x)
    for k, v in want.items():
        torch.testing.assert_close(params[k], v, rtol=1e-12, atol=1e-14)


def test_fused_optimizer_kernels_are_torchs_fused_optimizers():
    """fused_adam / fused_sgd are the kernels of torch.optim's fused=True, bit for bit."""
    for cls, call in (
        (torch.optim.AdamW, lambda p, g, s: _compat.fused_adam(
            [p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], [], [torch.tensor(1.0)], lr=0.1,
            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
            maximize=False, decoupled=True)),
        (torch.optim.Adam, lambda p, g, s: _compat.fused_adam(
            [p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], [], [torch.tensor(1.0)], lr=0.1,
            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
            maximize=False, decoupled=False)),
        (torch.optim.SGD, lambda p, g, s: _compat.fused_sgd(
            [p], [g], [], weight_decay=0.01, momentum=0.0, lr=0.1, dampening=0.0,
            nesterov=False, maximize=False, is_first_step=True)),
    ):  # fmt: skip
        w = torch.nn.Parameter(torch.randn(5))
        g = torch.randn(5)
        p = w.detach().clone()
        opt = cls([w], lr=0.1, weight_decay=0.01, fused=True)
        w.grad = g.clone()
        opt.step()
        state = {"exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
        call(p, g.clone(), state)
        assert torch.equal(p, w.detach()), cls


def test_optree_global_namespace_lets_a_users_optree_see_a_flat_by_name():
    import optree

    import funcgrad as fg

    assert _compat.optree_global_namespace() is not None  # optree still has the sentinel
    model = torch.nn.Linear(2, 1)
    flat = fg.params(model)
    leaves = optree.tree_leaves(flat)  # no namespace: the global one
    assert [tuple(t.shape) for t in leaves] == [(1, 2), (1,)]
    doubled = optree.tree_map(lambda t: t * 2, flat)
    assert torch.equal(doubled["weight"], model.weight.detach() * 2)


def test_global_forward_hook_goes_in_and_out_of_torchs_table_under_one_key():
    from torch.nn.modules import module

    seen: list[str] = []
    hook = _compat.GlobalForwardHook(
        lambda m, args, kwargs, out: seen.append(type(m).__name__),
        lambda m, args: seen.append("pre"),
    )
    lin = torch.nn.Linear(2, 2)
    other = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    other_pre = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    before = dict(module._global_forward_hooks)
    before_pre = dict(module._global_forward_pre_hooks)
    assert hook.key not in module._global_forward_hooks
    for _ in range(2):
        hook.add()
        hook.add()  # idempotent
        assert next(iter(module._global_forward_hooks)) == hook.key  # first: runs first
        assert list(module._global_forward_hooks)[1:] == list(before)
        assert module._global_forward_hooks_with_kwargs[hook.key] is True
        assert next(iter(module._global_forward_pre_hooks)) == hook.pre_key
        assert list(module._global_forward_pre_hooks)[1:] == list(before_pre)
        lin(torch.ones(1, 2))
        hook.remove()
        hook.remove()
        assert dict(module._global_forward_hooks) == before
        assert dict(module._global_forward_pre_hooks) == before_pre
        assert hook.key not in module._global_forward_hooks_with_kwargs
        lin(torch.ones(1, 2))
    other.remove()
    other_pre.remove()
    assert seen == ["pre", "Linear", "pre", "Linear"]
