"""fg.Optimizer as a drop-in for torch.optim scripts (issue "A drop-in for every
torch.optim script"): every form of ``params`` torch takes, param groups whose keys
override tx's hyperparameters, ``add_param_group`` mid-training, every hyperparameter a
scheduler writes, torch's argument order; each against torch.optim run with the same
groups (float64, 1e-12 relative, 10 steps)."""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from references import SeedModel
from torch import nn

import funcgrad as fg

D = torch.float64
STEPS = 10
X = torch.randn(12, 3, generator=torch.Generator().manual_seed(3), dtype=D)
Y = torch.randn(12, 2, generator=torch.Generator().manual_seed(4), dtype=D)


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)
    ).to(D)


def loss_of(model: nn.Module) -> torch.Tensor:
    return (model(X) - Y).pow(2).mean()


def train(model, opt, steps=STEPS, sched=None, before=None, plateau=False):
    for i in range(steps):
        if before is not None:
            before(i, opt)
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step(loss.item()) if plateau else sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def close(got, want, rtol=1e-12, atol=1e-14):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


def differs(got, want):
    return any(not torch.allclose(got[k], want[k], rtol=1e-9, atol=1e-12) for k in want)


# ---- every form of params torch.optim takes


def test_the_questions_script_with_only_its_optimizer_line_changed():
    """The seed question's own loop: `opt = optim.Adam(net.parameters())` becomes
    `fg.Optimizer(net.parameters(), fg.adam())`; equal to torch."""

    def run(make_opt):
        torch.manual_seed(0)
        model = SeedModel().to(D)
        opt = make_opt(model)
        features = torch.rand((3, 1), generator=torch.Generator().manual_seed(0), dtype=D)
        for _ in range(10):
            opt.zero_grad()
            out = model(features)
            loss = torch.mean(torch.square(torch.tensor(5) - torch.sum(out)))
            loss.backward()
            opt.step()
        return {n: p.detach() for n, p in model.named_parameters()}

    want = run(lambda m: torch.optim.Adam(m.parameters()))
    close(run(lambda m: fg.Optimizer(m.parameters(), fg.adam())), want)
    # and with the rule in front (the model passed: the rule names its layers):
    # equal to fg.make_step with the same tx
    features = torch.rand((3, 1), generator=torch.Generator().manual_seed(0), dtype=D)

    def seed_loss(model):
        return lambda p: torch.mean(torch.square(5 - fg.call(model, p, features).sum()))

    def tx_for(model):
        rule = fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model))
        return fg.chain(rule, fg.adam())

    torch.manual_seed(0)
    a = SeedModel().to(D)
    b = copy.deepcopy(a)
    tx = tx_for(a)
    params, state = fg.params(a), tx.init(fg.params(a))
    step = fg.make_step(seed_loss(a), tx)
    for _ in range(10):
        params, state, _ = step(params, state)
    opt = fg.Optimizer(b, tx_for(b))
    for _ in range(10):
        opt.zero_grad()
        seed_loss(b)(dict(b.named_parameters())).backward()
        opt.step()
    close(dict(b.named_parameters()), dict(params))


FORMS = {
    "module": lambda m: m,
    "named_parameters": lambda m: m.named_parameters(),
    "parameters": lambda m: m.parameters(),
    "groups of parameters": lambda m: [{"params": list(m.parameters())}],
    "groups of pairs": lambda m: [{"params": list(m.named_parameters())}],
    "generator of parameters in a group": lambda m: [{"params": m.parameters()}],
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_of_params_equals_torch(form):
    a, b = net(0), net(0)
    want = train(a, torch.optim.AdamW(a.parameters(), lr=1e-2))
    opt = fg.Optimizer(FORMS[form](b), fg.adamw(lr=1e-2))
    close(train(b, opt), want)
    names = opt.param_groups[0]["param_names"]
    if form in ("parameters", "groups of parameters", "generator of parameters in a group"):
        assert names == [str(i) for i in range(6)]  # the index, as state_dict numbers them
    else:
        assert names == [n for n, _ in b.named_parameters()]


# ---- param groups, for every optimizer funcgrad has


def weights(m):
    return [m[0].weight, m[2].weight]


def biases(m):
    return [m[0].bias, m[2].bias]


def last(m):
    return list(m[4].parameters())


# (factory, twin, base kwargs, second group's keys, added group's keys, matrices only)
GROUPED = {
    "adam": (
        fg.adam, torch.optim.Adam, {"lr": 1e-2},
        {"lr": 3e-2, "weight_decay": 0.1, "betas": (0.8, 0.99)},
        {"lr": 5e-3, "amsgrad": True, "eps": 1e-6}, False,
    ),
    "adamw": (
        fg.adamw, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1},
        {"weight_decay": 0.0, "lr": 2e-2}, {"eps": 1e-6, "maximize": True}, False,
    ),
    "sgd": (
        fg.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True},
        {"momentum": 0.5, "nesterov": False, "dampening": 0.1, "lr": 0.1},
        {"momentum": 0.0, "nesterov": False, "weight_decay": 0.01}, False,
    ),
    "rmsprop": (
        fg.rmsprop, torch.optim.RMSprop, {"lr": 1e-2},
        {"momentum": 0.5, "centered": True, "weight_decay": 0.1}, {"alpha": 0.9, "lr": 5e-3},
        False,
    ),
    "adagrad": (
        fg.adagrad, torch.optim.Adagrad, {"lr": 0.1},
        {"lr_decay": 0.01, "weight_decay": 0.1}, {"eps": 1e-8, "lr": 0.05},
        False,
    ),
    "adafactor": (
        fg.adafactor, torch.optim.Adafactor, {"lr": 0.05},
        {"weight_decay": 0.1, "d": 1.5}, {"beta2_decay": -0.5, "lr": 0.02}, False,
    ),
    "muon": (
        fg.muon, torch.optim.Muon, {"lr": 0.02},
        {"momentum": 0.9, "nesterov": False, "lr": 0.01},
        {"weight_decay": 0.0, "adjust_lr_fn": "match_rms_adamw"}, True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GROUPED))
def test_param_groups_and_a_group_added_mid_training_equal_torch(name):
    """Two groups with their own keys, a third added after 4 steps (its state starts
    there, the others go on), a scheduler over all: equal to the torch twin."""
    make, twin, base, second, added, matrices = GROUPED[name]
    a, b = net(0), net(0)
    rtol = 1e-5 if name == "muon" else 1e-12  # bfloat16 Newton-Schulz, as torch's
    if matrices:  # Muon takes the weight matrices; the biases are frozen in both
        for m in (a, b):
            for p in [*biases(m), m[4].bias]:
                p.requires_grad_(False)

    def add(m):
        return {"params": [m[4].weight] if matrices else last(m), **added}

    def first(m):
        if matrices:
            return [{"params": [m[0].weight]}, {"params": [m[2].weight], **second}]
        return [{"params": weights(m)}, {"params": biases(m), **second}]

    first_a, first_b = first(a), first(b)

    def adder(m):
        def before(i, opt):
            if i == 4:
                opt.add_param_group(add(m))

        return before

    ref = twin(first_a, **base)
    want = train(a, ref, sched=torch.optim.lr_scheduler.ExponentialLR(ref, 0.9), before=adder(a))
    opt = fg.Optimizer(first_b, make(**base))
    got = train(b, opt, sched=torch.optim.lr_scheduler.ExponentialLR(opt, 0.9), before=adder(b))
    close(got, want, rtol=rtol, atol=rtol * 1e-2)
    assert len(opt.param_groups) == 3
    for g, r in zip(opt.param_groups, ref.param_groups, strict=True):
        for k, v in r.items():
            if k in g and k not in ("params", "initial_lr"):
                assert g[k] == v or isinstance(v, bool | None), (k, g[k], v)


def test_adagrad_honours_a_groups_initial_accumulator_value():
    """torch.optim.Adagrad starts every group at the constructor's
    initial_accumulator_value, whatever the group says (torch 2.13); fg.Optimizer at the
    group's, as torch does when it is the constructor's (docs/torch-loops.md)."""
    a, b = net(0), net(0)
    want = train(a, torch.optim.Adagrad(a.parameters(), lr=0.1, initial_accumulator_value=0.5))
    opt = fg.Optimizer(
        [{"params": b.parameters(), "initial_accumulator_value": 0.5}], fg.adagrad(lr=0.1)
    )
    close(train(b, opt), want)


def test_lion_groups_equal_a_partition_of_two_lions():
    """Lion has no torch twin: its param groups against fg.partition of two fg.lion,
    another mechanism, in fg.make_step."""
    a, b = net(0), net(0)
    names_w = ["0.weight", "2.weight", "4.weight"]
    labels = {n: "w" if n in names_w else "b" for n, _ in a.named_parameters()}
    tx = fg.partition(
        {"w": fg.lion(lr=1e-3), "b": fg.lion(lr=3e-3, b1=0.8, weight_decay=0.1)}, labels
    )
    params = {n: p.detach().clone() for n, p in a.named_parameters()}
    state = tx.init(params)
    step = fg.make_step(lambda p: (fg.call(a, p, X) - Y).pow(2).mean(), tx)
    for _ in range(STEPS):
        params, state, _ = step(params, state)
    groups = [
        {"params": [p for n, p in b.named_parameters() if n in names_w]},
        {
            "params": [p for n, p in b.named_parameters() if n not in names_w],
            "lr": 3e-3, "b1": 0.8, "weight_decay": 0.1,
        },
    ]  # fmt: skip
    close(train(b, fg.Optimizer(groups, fg.lion(lr=1e-3))), params)


def test_grouped_in_make_step_equals_fg_optimizer_and_compiles_to_one_graph():
    """fg.grouped is the one mechanism: fg.make_step over fg.grouped(tx, groups) equals
    fg.Optimizer with the same groups, eagerly and compiled with inductor (one graph)."""
    from torch._dynamo.utils import counters

    a, b, c = net(0), net(0), net(0)
    rule = lambda m: fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m))  # noqa: E731
    decay = ["0.weight", "2.weight", "4.weight"]
    spec = [
        {"params": decay, "weight_decay": 0.1},
        {"params": ["0.bias", "2.bias", "4.bias"], "weight_decay": 0.0, "lr": 3e-2},
    ]
    # (name, parameter) pairs: the rule names the model's layers
    opt = fg.Optimizer(
        [
            {
                "params": [(n, p) for n, p in b.named_parameters() if n in decay],
                "weight_decay": 0.1,
            },
            {
                "params": [(n, p) for n, p in b.named_parameters() if n not in decay],
                "weight_decay": 0.0,
                "lr": 3e-2,
            },
        ],
        fg.chain(rule(b), fg.adamw(lr=1e-2)),
    )
    want = train(b, opt)
    for model, compile in ((a, False), (c, True)):
        tx = fg.grouped(fg.chain(rule(model), fg.adamw(lr=1e-2)), spec)
        params = fg.params(model)
        state = tx.init(params)
        step = fg.make_step(
            lambda p, model=model: (fg.call(model, p, X) - Y).pow(2).mean(), tx, compile=compile
        )
        counters.clear()
        for _ in range(STEPS):
            params, state, _ = step(params, state)
        close(dict(params), want)
        if compile:
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # the no-decay group was built with its term off: not in its state
    assert [h.get("weight_decay") for h in fg.get_hyperparams(state)] == [0.1, None]


# ---- every hyperparameter a scheduler or the user writes


SCHEDULED = {
    "onecycle adam (beta1)": (
        torch.optim.Adam, fg.adam, {"lr": 1e-2},
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    ),
    "onecycle adamw (beta1)": (
        torch.optim.AdamW, fg.adamw, {"lr": 1e-2},
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    ),
    "onecycle sgd (momentum)": (
        torch.optim.SGD, fg.sgd, {"lr": 1e-2, "momentum": 0.9},
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS),
    ),
    "onecycle sgd built without momentum": (
        torch.optim.SGD, fg.sgd, {"lr": 1e-2},
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS),
    ),
    "cyclic sgd (momentum)": (
        torch.optim.SGD, fg.sgd, {"lr": 1e-2, "momentum": 0.9},
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    ),
    "cyclic adam (beta1)": (
        torch.optim.Adam, fg.adam, {"lr": 1e-2},
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.001, 0.01, step_size_up=3),
    ),
    "plateau": (
        torch.optim.RMSprop, fg.rmsprop, {"lr": 1e-2},
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_torch_schedulers_equal_torch(name):
    twin, make, kw, sched = SCHEDULED[name]
    a, b = net(0), net(0)
    plateau = name == "plateau"
    ref = twin(a.parameters(), **kw)
    want = train(a, ref, sched=sched(ref), plateau=plateau)
    opt = fg.Optimizer(b, make(**kw))
    got = train(b, opt, sched=sched(opt), plateau=plateau)
    close(got, want)
    for k, v in ref.param_groups[0].items():
        if k in opt.param_groups[0] and k != "params":
            assert opt.param_groups[0][k] == v, k


@pytest.mark.parametrize("start", [0.1, 0.0])
def test_a_hand_written_weight_decay_schedule_equals_torch(start):
    """group["weight_decay"] written before every step (from zero: the term is turned
    on, which rebuilds the optimizer with its state carried over)."""

    def schedule(i, opt):
        for g in opt.param_groups:
            g["weight_decay"] = 0.05 * i if start == 0.0 else start * (1 - i / STEPS)

    a, b = net(0), net(0)
    want = train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=start), before=schedule)
    opt = fg.Optimizer(b, fg.adamw(lr=1e-2, weight_decay=start))
    close(train(b, opt, before=schedule), want)
    assert fg.get_hyperparams(opt.tx_state)[0]["weight_decay"] == pytest.approx(
        opt.param_groups[0]["weight_decay"]
    )


# each key written at step 3, against torch with the same write; and it changes the result
WRITES = [
    (torch.optim.Adam, fg.adam, {"lr": 1e-2}, "betas", (0.5, 0.9)),
    (torch.optim.Adam, fg.adam, {"lr": 1e-2}, "eps", 1e-1),
    (torch.optim.Adam, fg.adam, {"lr": 1e-2}, "weight_decay", 0.5),
    (torch.optim.Adam, fg.adam, {"lr": 1e-2}, "maximize", True),
    (torch.optim.AdamW, fg.adamw, {"lr": 1e-2}, "weight_decay", 0.5),
    (torch.optim.SGD, fg.sgd, {"lr": 1e-2, "momentum": 0.9}, "momentum", 0.1),
    (torch.optim.SGD, fg.sgd, {"lr": 1e-2, "momentum": 0.9}, "dampening", 0.5),
    (torch.optim.SGD, fg.sgd, {"lr": 1e-2, "momentum": 0.9}, "nesterov", True),
    (torch.optim.SGD, fg.sgd, {"lr": 1e-2}, "momentum", 0.9),
    (torch.optim.RMSprop, fg.rmsprop, {"lr": 1e-2}, "alpha", 0.5),
    (torch.optim.RMSprop, fg.rmsprop, {"lr": 1e-2}, "eps", 1e-1),
    (torch.optim.Adagrad, fg.adagrad, {"lr": 0.1}, "lr_decay", 0.5),
    (torch.optim.Adafactor, fg.adafactor, {"lr": 0.05}, "d", 1.01),
    (torch.optim.Adafactor, fg.adafactor, {"lr": 0.05}, "beta2_decay", -0.2),
    (torch.optim.Adafactor, fg.adafactor, {"lr": 0.05}, "eps", (1e-2, 1e-1)),
]


@pytest.mark.parametrize(
    ("twin", "make", "kw", "key", "value"), WRITES, ids=[f"{w[1].__name__}-{w[3]}" for w in WRITES]
)
def test_each_key_written_into_a_group_takes_effect_as_in_torch(twin, make, kw, key, value):
    def write(i, opt):
        if i == 3:
            opt.param_groups[0][key] = value

    a, b, c = net(0), net(0), net(0)
    want = train(a, twin(a.parameters(), **kw), before=write)
    got = train(b, fg.Optimizer(b, make(**kw)), before=write)
    close(got, want)
    assert differs(got, train(c, fg.Optimizer(c, make(**kw))))


def test_every_hyperparameter_is_state_and_a_compiled_step_never_recompiles():
    """fg.set_hyperparams between compiled (inductor) steps: no recompile, equal to the
    eager steps with the same writes."""
    from torch._dynamo.utils import counters

    runs = []
    for compile in (False, True):
        model = net(0)
        tx = fg.adamw(lr=1e-2, weight_decay=0.1)
        step = fg.make_step(
            lambda p, model=model: (fg.call(model, p, X) - Y).pow(2).mean(), tx, compile=compile
        )
        params = fg.params(model)
        state = tx.init(params)
        torch._dynamo.reset()
        counters.clear()
        for i in range(6):
            state = fg.set_hyperparams(
                state, lr=1e-2 / (1 + i), betas=(0.9 - 0.05 * i, 0.99), eps=10.0**-i,
                weight_decay=0.1 * i,
            )  # fmt: skip
            params, state, _ = step(params, state)
        if compile:
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        runs.append(dict(params))
    close(runs[1], runs[0], rtol=1e-12, atol=1e-14)


def test_a_term_built_off_is_not_in_the_state_and_setting_it_says_how():
    state = fg.adam().init({"w": torch.zeros(2)})
    assert fg.get_hyperparams(state) == [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}]
    with pytest.raises(KeyError, match=re.escape("A term built off (weight_decay=0.0")):
        fg.set_hyperparams(state, weight_decay=0.1)
    on = fg.adam(weight_decay=torch.tensor(0.0, dtype=D)).init({"w": torch.zeros(2)})
    assert fg.get_hyperparams(fg.set_hyperparams(on, weight_decay=0.1))[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match=re.escape("Invalid beta parameter at index 1: 1.5")):
        fg.set_hyperparams(state, betas=(0.9, 1.5))


# ---- torch's argument order; no silent misreading


TWINS = {
    fg.sgd: torch.optim.SGD,
    fg.adam: torch.optim.Adam,
    fg.adamw: torch.optim.AdamW,
    fg.rmsprop: torch.optim.RMSprop,
    fg.adagrad: torch.optim.Adagrad,
    fg.adafactor: torch.optim.Adafactor,
    fg.muon: torch.optim.Muon,
    fg.adamax: torch.optim.Adamax,
    fg.nadam: torch.optim.NAdam,
    fg.asgd: torch.optim.ASGD,
    fg.lbfgs: torch.optim.LBFGS,
    fg.radam: torch.optim.RAdam,
    fg.adadelta: torch.optim.Adadelta,
    fg.rprop: torch.optim.Rprop,
}
IMPLEMENTATION = {"foreach", "fused", "capturable", "differentiable"}


@pytest.mark.parametrize("make", list(TWINS), ids=lambda f: f.__name__)
def test_positional_order_is_torchs_and_the_rest_keyword_only(make):
    ours = inspect.signature(make).parameters
    theirs = [
        n for n, p in inspect.signature(TWINS[make].__init__).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD and n not in ("self", "params")
    ]  # fmt: skip
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    # torch's positional arguments up to its first implementation flag, in its order
    cut = next((i for i, n in enumerate(theirs) if n in IMPLEMENTATION), len(theirs))
    assert positional == theirs[:cut]
    for n, p in inspect.signature(TWINS[make].__init__).parameters.items():
        if n not in ("self", "params") and n not in IMPLEMENTATION:
            assert n in ours, n  # every math option torch has
            assert ours[n].default == p.default, n


def test_sgd_positional_weight_decay_is_torchs():
    a, b = net(0), net(0)
    want = train(a, torch.optim.SGD(a.parameters(), 0.1, 0.9, 0.0, 5e-4))
    close(train(b, fg.Optimizer(b, fg.sgd(0.1, 0.9, 0.0, 5e-4))), want)


BAD = [
    ("fg.sgd: nesterov must be a bool, got 0.0005", lambda: fg.sgd(0.1, 0.9, 0.0, 5e-4, 5e-4)),
    ("fg.adam: amsgrad must be a bool, got 1", lambda: fg.adam(amsgrad=1)),
    ("fg.rmsprop: centered must be a bool", lambda: fg.rmsprop(centered="yes")),
    ("fg.muon: nesterov must be a bool", lambda: fg.muon(nesterov=0)),
    ("fg.adam: maximize must be a bool", lambda: fg.adam(maximize=1.0)),
]


@pytest.mark.parametrize(("message", "build"), BAD, ids=[b[0][:30] for b in BAD])
def test_a_bool_option_given_a_non_bool_is_an_error(message, build):
    with pytest.raises(TypeError, match=re.escape(message)):
        build()


def test_mixed_betas_are_refused_and_one_element_tensors_accepted():
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        fg.adam(betas=(0.9, torch.tensor(0.99)))
    a, b = net(0), net(0)
    want = train(a, torch.optim.Adam(a.parameters(), lr=torch.tensor([0.01], dtype=D)))
    got = train(b, fg.Optimizer(b, fg.adam(lr=torch.tensor([0.01], dtype=D))))
    close(got, want)
    with pytest.raises(ValueError, match="must be 1-element"):
        fg.adam(lr=torch.tensor([0.01, 0.02]))


def test_a_parameter_listed_twice_is_refused():
    m = net(0)
    with pytest.raises(ValueError, match=re.escape("a parameter is listed twice in param group 0")):
        fg.Optimizer([m[0].weight, m[0].weight], fg.adagrad())
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        fg.Optimizer([{"params": [m[0].weight]}, {"params": [m[0].weight]}], fg.adagrad())


def test_add_param_group_trains_the_added_parameters():
    """The bug: a parameter with gradient 1 and SGD lr 0.1 stayed at 0.0."""
    w, v = nn.Parameter(torch.zeros(1, dtype=D)), nn.Parameter(torch.zeros(1, dtype=D))
    opt = fg.Optimizer([w], fg.sgd(lr=0.1))
    opt.add_param_group({"params": [v]})
    (w + v).sum().backward()
    opt.step()
    assert float(v.detach()) == pytest.approx(-0.1) and float(w.detach()) == pytest.approx(-0.1)
    assert opt.param_groups[1]["lr"] == 0.1 and opt.param_groups[1]["momentum"] == 0.0


@pytest.mark.parametrize("path", ["fused", "general"])
@pytest.mark.parametrize("key", ["weight_decay", "momentum"])
def test_a_term_a_group_was_built_without_turns_on_when_written(key, path, monkeypatch):
    """A group added (or built) with weight_decay=0.0 (or momentum=0.0) holds no state for
    it; writing a nonzero value later must rebuild it, not be dropped (it was). And a
    momentum written to 0.0 is plain SGD that leaves the buffer, as torch. On the fused
    kernels and on the general path (funcgrad/optim/_fused.py)."""
    if path == "general":
        from funcgrad.optim import _fused

        monkeypatch.setattr(_fused, "plan", lambda *args: None)

    def run(make):
        model = net(0)
        model[4].requires_grad_(False)
        opt = make([p for p in model.parameters() if p.requires_grad])

        def before(i, opt):
            if i == 3:
                model[4].requires_grad_(True)
                opt.add_param_group({"params": model[4].parameters(), key: 0.0})
            for g in opt.param_groups:  # 0.0 when the group is added, then 0.5
                g[key] = 0.5 * (i % 3 != 0)

        return train(model, opt, before=before)

    if key == "weight_decay":
        close(
            run(lambda ps: fg.Optimizer(ps, fg.adamw(0.1, weight_decay=0.1))),
            run(lambda ps: torch.optim.AdamW(ps, 0.1, weight_decay=0.1)),
        )
    else:
        close(
            run(lambda ps: fg.Optimizer(ps, fg.sgd(0.1, 0.9))),
            run(lambda ps: torch.optim.SGD(ps, 0.1, 0.9)),
        )


def test_group_keys_no_optimizer_in_tx_takes_are_refused_and_others_kept():
    m = net(0)
    with pytest.raises(
        KeyError,
        match=re.escape("param group key(s) ['momentum'] are hyperparameters no optimizer"),
    ):
        fg.Optimizer([{"params": m.parameters(), "momentum": 0.9}], fg.adam())
    opt = fg.Optimizer([{"params": m.parameters(), "name": "all", "foreach": True}], fg.adam())
    assert opt.param_groups[0]["name"] == "all"  # the user's own key, kept as torch keeps it


def test_a_frozen_parameter_unfrozen_without_add_param_group_is_an_error():
    m = net(0)
    m[4].requires_grad_(False)
    opt = fg.Optimizer(m.parameters(), fg.adam())
    m[4].requires_grad_(True)
    loss_of(m).backward()
    with pytest.raises(ValueError, match=re.escape("was frozen (requires_grad=False) when it was")):
        opt.step()


def test_progressive_unfreezing_equals_torch():
    """The module form: the frozen head is left out, then unfrozen and added with its own
    lr (named from the module); equal to torch.optim.AdamW doing the same."""

    def run(make):
        model = net(0)
        model[4].requires_grad_(False)
        opt = make(model)

        def unfreeze(i, opt):
            if i == 5:
                model[4].requires_grad_(True)
                opt.add_param_group({"params": model[4].parameters(), "lr": 3e-3})

        return train(model, opt, before=unfreeze), opt

    want, _ = run(lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]))
    got, opt = run(lambda m: fg.Optimizer(m, fg.adamw()))
    close(got, want)
    assert opt.param_groups[1]["param_names"] == ["4.weight", "4.bias"]


def test_one_tx_shared_by_two_grouped_optimizers():
    """Two fg.Optimizers from one tx, with their own groups and schedulers, interleaved:
    each equals its own torch.optim run."""
    tx = fg.sgd(lr=0.05, momentum=0.9)
    a, b = net(0), net(1)
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)

    def groups(m, lr):
        return [
            {"params": [*weights(m), m[4].weight]},
            {"params": [*biases(m), m[4].bias], "lr": lr},
        ]

    oa, ob = fg.Optimizer(groups(a, 0.01), tx), fg.Optimizer(groups(b, 0.2), tx)
    sa = torch.optim.lr_scheduler.StepLR(oa, 2, 0.5)
    sb = torch.optim.lr_scheduler.LinearLR(ob, 0.5, total_iters=4)
    for _ in range(6):
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            loss_of(m).backward()
            o.step()
            s.step()
    ta = torch.optim.SGD(groups(ra, 0.01), lr=0.05, momentum=0.9)
    tb = torch.optim.SGD(groups(rb, 0.2), lr=0.05, momentum=0.9)
    close(dict(a.named_parameters()), train(ra, ta, 6, torch.optim.lr_scheduler.StepLR(ta, 2, 0.5)))
    close(
        dict(b.named_parameters()),
        train(rb, tb, 6, torch.optim.lr_scheduler.LinearLR(tb, 0.5, total_iters=4)),
    )


def test_a_tensor_lr_in_a_group_edited_in_place_by_a_scheduler_equals_torch():
    a, b = net(0), net(0)

    def groups(m):
        return [
            {"params": weights(m)},
            {"params": biases(m) + last(m), "lr": torch.tensor(0.02, dtype=D)},
        ]

    ref = torch.optim.Adam(groups(a), lr=torch.tensor(0.01, dtype=D))
    want = train(a, ref, sched=torch.optim.lr_scheduler.CosineAnnealingLR(ref, 5))
    opt = fg.Optimizer(groups(b), fg.adam(lr=torch.tensor(0.01, dtype=D)))
    close(train(b, opt, sched=torch.optim.lr_scheduler.CosineAnnealingLR(opt, 5)), want)


def test_state_dict_with_groups_and_an_added_group_resumes_bit_for_bit():
    def build(m):
        opt = fg.Optimizer(
            [{"params": weights(m)}, {"params": biases(m), "weight_decay": 0.0}],
            fg.adamw(lr=1e-2, weight_decay=0.1),
        )
        opt.add_param_group({"params": last(m), "lr": 3e-3, "amsgrad": True})
        return opt, torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)

    a, b = net(0), net(0)
    oa, sa = build(a)
    want = train(a, oa, 8, sa)
    ob, sb = build(b)
    train(b, ob, 4, sb)
    saved = copy.deepcopy({"m": b.state_dict(), "o": ob.state_dict(), "s": sb.state_dict()})
    c = net(5)
    c.load_state_dict(saved["m"])
    oc, sc = build(c)
    oc.load_state_dict(saved["o"])
    sc.load_state_dict(saved["s"])
    close(train(c, oc, 4, sc), want, rtol=0, atol=0)


# ---- facts travel on the transformation


def test_a_transformation_built_from_anothers_functions_inherits_no_facts():
    tx = fg.adam()
    assert tx.facts.shardable and tx.facts.optimizer.who == "fg.adam"
    copy_ = fg.GradientTransformation(tx.init, tx.update)
    assert not copy_.facts.shardable and copy_.facts.optimizer is None
    init, update = tx  # still a pair
    assert init is tx.init and update is tx.update


# ---- every subpackage's __all__


@pytest.mark.parametrize(
    "module",
    ["funcgrad", "funcgrad.rules", "funcgrad.hooks", "funcgrad.core", "funcgrad.optim",
     "funcgrad.step", "funcgrad.transforms", "funcgrad.io", "funcgrad.distributed",
     "funcgrad.torch_optim"],
)  # fmt: skip
def test_star_import_works(module):
    import importlib

    mod = importlib.import_module(module)
    for name in getattr(mod, "__all__", ()):
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which it lacks"
    namespace: dict = {}
    exec(f"from {module} import *", namespace)
