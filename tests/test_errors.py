"""Every error in docs/errors.md: triggered here, with its exact text checked.

The table in the docs and CASES below must agree: test_docs_table_is_covered reads
the table and fails for a documented message that no case triggers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from references import SeedModel
from torch import nn

import funcgrad as fg
from funcgrad import rules

P = {"w": torch.zeros(2)}


def _adam_state():
    return fg.adam().init(P)


def _load_params_non_tensor():
    model = nn.Linear(1, 1)
    fg.load_params(model, {"weight": [[1.0]], "bias": torch.zeros(1)})


def _step(**kw):
    model = nn.Linear(2, 1)

    def loss(p, x):
        return fg.call(model, p, x).sum()

    tx = fg.adam()
    p = fg.params(model)
    return fg.make_step(loss, tx, **kw), p, tx.init(p)


def _sgd_pair(momentum_torch=0.0, momentum_fg=0.0):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum_torch)
    return fg.sgd(lr=0.1, momentum=momentum_fg), opt, fg.params(model)


def _from_torch_count_zero():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    fg.state_from_torch(fg.sgd(lr=0.1, momentum=0.9), opt, fg.params(model), count=0)


def _to_torch_other_state():
    tx, opt, params = _sgd_pair()
    fg.state_to_torch(tx, fg.adam().init(params), opt, params)


def _per_sample_no_batch():
    step, p, s = _step(per_sample=fg.clip_by_global_norm(1.0))
    step(p, s, torch.tensor(1.0))


def _lstm_step_compiled(scope: str = "step"):
    torch._dynamo.reset()
    model = nn.LSTM(3, 4, batch_first=True)
    tx = fg.adam()
    step = fg.make_step(
        lambda p, x: fg.call(model, p, x)[0].sum(),
        tx,
        compile={"backend": "aot_eager", "scope": scope},
    )
    p = fg.params(model)
    step(p, tx.init(p), torch.randn(2, 5, 3))


def _python_if_schedule_in_step(compile):
    def warmup(count):
        return 0.01 if count < 10 else 0.1

    torch._dynamo.reset()
    model = nn.Linear(2, 1)
    tx = fg.adam(lr=warmup)
    step = fg.make_step(lambda p, x: fg.call(model, p, x).sum(), tx, compile=compile)
    p = fg.params(model)
    step(p, tx.init(p), torch.ones(1, 2))


def _compiled_linear_step(params_fn, loss=None, compile=True):
    torch._dynamo.reset()
    model = nn.Linear(2, 1)
    tx = fg.adam()

    def default_loss(p, x):
        return fg.call(model, p, x).sum()

    step = fg.make_step(
        loss or default_loss, tx, compile={"backend": "aot_eager"} if compile else False
    )
    p = params_fn(model)
    state = tx.init({k: v.detach() for k, v in p.items()})
    step(p, state, torch.ones(3, 2))


class _UserError(Exception):
    pass


def _raises_user_error(p, x):
    raise _UserError("the user's own error, raised in loss_fn")


def _meta_params(model):
    return {k: torch.empty_like(v, device="meta") for k, v in fg.params(model).items()}


def _misspelled(model):
    p = dict(fg.params(model))  # a plain dict: fg.params returns a read-only mapping
    p["wieght"] = p.pop("weight")
    return p


def _extra_key(model):
    return {**fg.params(model), "gamma": torch.ones(1)}


def _python_if_in_a_rule():
    model = nn.Linear(2, 1)

    def rule(group):  # a host branch: not allowed in per-step code
        return (
            {k: 2 * t for k, t in group.items()}
            if bool((group["weight"] == 0).all())
            else dict(group)
        )

    tx = fg.chain(fg.per_group(rule, fg.group_by_module(model)), fg.adam())
    step = fg.make_step(lambda p, x: fg.call(model, p, x).sum(), tx)
    p = fg.params(model)
    step(p, tx.init(p), torch.ones(1, 2))


CASES = [
    (
        "Nesterov momentum requires a momentum and zero dampening",
        ValueError,
        lambda: fg.sgd(nesterov=True),
    ),
    ("Invalid momentum value: -0.5", ValueError, lambda: fg.sgd(momentum=-0.5)),
    ("Invalid alpha value: -1.0", ValueError, lambda: fg.rmsprop(alpha=-1.0)),
    ("Invalid lr_decay value: -1.0", ValueError, lambda: fg.adagrad(lr_decay=-1.0)),
    (
        "Invalid initial_accumulator_value value: -1.0",
        ValueError,
        lambda: fg.adagrad(initial_accumulator_value=-1.0),
    ),
    (
        "Invalid eps: 0.001; fg.adafactor takes a pair (eps1, eps2)",
        ValueError,
        lambda: fg.adafactor(eps=1e-3),
    ),
    ("Invalid eps[1]: None. Use a float", TypeError, lambda: fg.adafactor(eps=(None, None))),
    ("beta2_decay should be <= 0 but is: 0.5", ValueError, lambda: fg.adafactor(beta2_decay=0.5)),
    ("Clipping threshold d should be >= 1 but is: 0.5", ValueError, lambda: fg.adafactor(d=0.5)),
    (
        "fg.muon: Muon only supports 2D parameters; {'bias': (1,)} are not 2-D",
        ValueError,
        lambda: fg.muon().init(fg.params(nn.Linear(2, 1))),
    ),
    (
        "Adjust learning rate function sqrt is not supported",
        ValueError,
        lambda: fg.muon(adjust_lr_fn="sqrt"),
    ),
    (
        "Invalid ns_steps: 100; expected an int in [0, 100).",
        ValueError,
        lambda: fg.muon(ns_steps=100),
    ),
    (
        "fg.sgd.update: the state does not fit these gradients",
        KeyError,
        lambda: fg.sgd(momentum=0.9).update(P, fg.sgd().init(P)),
    ),
    (
        "fg.rmsprop needs the parameters (for its weight decay or scale)",
        ValueError,
        lambda: fg.rmsprop(weight_decay=0.1).update(P, fg.rmsprop().init(P)),
    ),
    (
        "fg.state_from_torch: expected exactly one optimizer state with a torch.optim twin",
        TypeError,
        lambda: fg.state_from_torch(fg.lion(), *_sgd_pair()[1:]),
    ),
    (
        "fg.state_from_torch: tx keeps an AdamState, whose torch.optim twin is torch.optim.Adam or torch.optim.AdamW; got SGD.",
        TypeError,
        lambda: fg.state_from_torch(fg.adam(), *_sgd_pair()[1:]),
    ),
    (
        "fg.state_from_torch: the torch optimizer's options keep state ['momentum_buffer'] but tx keeps []",
        ValueError,
        lambda: fg.state_from_torch(*_sgd_pair(momentum_torch=0.9)),
    ),
    ("fg.state_from_torch: count=0; expected an int >= 1", ValueError, _from_torch_count_zero),
    (
        "fg.state_to_torch: the state holds an AdamState but tx keeps an SGDState",
        TypeError,
        _to_torch_other_state,
    ),
    (
        "fg.sharded: tx must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.sharded(rules.zero_fix()),
    ),
    (
        "fg.sharded: tx contains fg.all_reduce_mean",
        ValueError,
        lambda: fg.sharded(fg.chain(fg.all_reduce_mean(), fg.adam())),
    ),
    (
        "fg.sharded: tx contains a transformation that is not known to work on row shards",
        TypeError,
        lambda: fg.sharded(fg.chain(fg.stateless(lambda g, p: g), fg.adam())),
    ),
    (
        "fg.sharded.init: torch.distributed is not initialized",
        RuntimeError,
        lambda: fg.sharded(fg.adam()).init(P),
    ),
    (
        "fg.sharded.update: the state was made for other parameters",
        ValueError,
        lambda: fg.sharded(fg.adam()).update(P, fg.ShardedState(_adam_state()), P),
    ),
    (
        "fg.state_dict: the state holds a ShardedState inside another transformation's state",
        TypeError,
        lambda: fg.state_dict(fg.ChainState((fg.ShardedState(_adam_state()),))),
    ),
    (
        "fg.state_dict: this ShardedState was not made by fg.sharded(...).init.",
        ValueError,
        lambda: fg.state_dict(fg.ShardedState(_adam_state())),
    ),
    (
        "fg.hooks.attach: scaler must be a torch.amp.GradScaler, got float.",
        TypeError,
        lambda: fg.hooks.attach(SeedModel(), rules.zero_fix(), {}, scaler=1024.0),
    ),
    (
        "fg.make_step: tx.update reads a tensor's value on the host",
        TypeError,
        _python_if_in_a_rule,
    ),
    (
        "fg.make_step: params['weight'] requires grad",
        ValueError,
        lambda: _compiled_linear_step(lambda m: dict(m.named_parameters())),
    ),
    (
        "requires grad. The step differentiates with torch.func.grad itself",
        ValueError,
        lambda: _compiled_linear_step(lambda m: dict(m.named_parameters()), compile=False),
    ),
    (
        "fg.make_step: params['weight'] is on the meta device: it has a shape but no data",
        ValueError,
        lambda: _compiled_linear_step(_meta_params),
    ),
    (
        "fg.call: 'wieght' is not a parameter of Linear (did you mean 'weight'?)",
        KeyError,
        lambda: _compiled_linear_step(_misspelled),
    ),
    (
        "fg.call: 'gamma' is not a parameter of Linear",
        KeyError,
        lambda: _compiled_linear_step(_extra_key),
    ),
    (
        "the user's own error, raised in loss_fn",
        _UserError,
        lambda: _compiled_linear_step(fg.params, loss=_raises_user_error),
    ),
    (
        "fg.make_step(compile=True): the model has an nn.RNN, nn.GRU or nn.LSTM, and torch.compile (dynamo) refuses to trace those modules. Use compile=False",
        TypeError,
        _lstm_step_compiled,
    ),
    (
        'fg.make_step(compile="gradients"): the model has an nn.RNN, nn.GRU or nn.LSTM',
        TypeError,
        lambda: _lstm_step_compiled("gradients"),
    ),
    (
        "fg.make_step: tx.update reads a tensor's value on the host (a Python if/while, bool(), float() or .item() on a tensor), in a schedule",
        TypeError,
        lambda: _python_if_schedule_in_step(False),
    ),
    (
        "write torch.where(count < 100, a, b) instead of a if count < 100 else b",
        TypeError,
        lambda: _python_if_schedule_in_step({"backend": "aot_eager"}),
    ),
    (
        "fg.join_schedules: schedules[1] is a float, not a schedule",
        TypeError,
        lambda: fg.join_schedules([fg.cosine_decay(1.0, 10), 0.1], [5]),
    ),
    (
        "fg.join_schedules: 2 schedules need 1 boundaries, got 0.",
        ValueError,
        lambda: fg.join_schedules([fg.cosine_decay(1.0, 10)] * 2, []),
    ),
    (
        "fg.join_schedules: boundaries must increase, got [5, 2].",
        ValueError,
        lambda: fg.join_schedules([fg.cosine_decay(1.0, 10)] * 3, [5, 2]),
    ),
    (
        "fg.linear_schedule: transition_steps must be a positive int, got 0.",
        ValueError,
        lambda: fg.linear_schedule(0.0, 1.0, 0),
    ),
    (
        "fg.warmup_cosine_decay: decay_steps counts the warmup too and must be > warmup_steps (10), got 10.",
        ValueError,
        lambda: fg.warmup_cosine_decay(0.0, 1.0, 10, 10),
    ),
    (
        "fg.warmup_cosine_decay: end_value (2.0) must lie between 0 and peak_value (1.0)",
        ValueError,
        lambda: fg.warmup_cosine_decay(0.0, 1.0, 1, 10, end_value=2.0),
    ),
    (
        "fg.cosine_decay: init_value must be a finite real number, got '1'.",
        TypeError,
        lambda: fg.cosine_decay("1", 10),
    ),
    (
        "fg.accumulate: every must be an int >= 1 (micro-steps per update), got 0.",
        ValueError,
        lambda: fg.accumulate(fg.adam(), every=0),
    ),
    (
        "fg.accumulate: tx must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.accumulate(rules.zero_fix(), every=2),
    ),
    (
        "fg.accumulate.update: expected an AccumulateState, got AdamState.",
        TypeError,
        lambda: fg.accumulate(fg.adam(), 2).update(P, _adam_state()),
    ),
    (
        "fg.adamw: the mask must name every parameter exactly; it has missing []; unexpected ['bias']",
        KeyError,
        lambda: fg.adamw(mask={"w": True, "bias": False}).init(P),
    ),
    (
        "fg.adam: mask values must be bool, got {'w': 1}.",
        TypeError,
        lambda: fg.adam(mask={"w": 1}),
    ),
    (
        "fg.adamw: the mask predicate must return a Python bool for each parameter",
        TypeError,
        lambda: fg.adamw(mask=lambda n, p: p.ndim).init(P),
    ),
    (
        "fg.adam: mask must be None, a dict name -> bool or a predicate (name, tensor) -> bool, got str.",
        TypeError,
        lambda: fg.adam(mask="bias"),
    ),
    (
        "fg.call: buffers ['running_mean'] are missing. Pass every entry of fg.buffers(model)",
        KeyError,
        lambda: fg.call(
            nn.BatchNorm1d(2),
            fg.params(nn.BatchNorm1d(2)),
            torch.ones(3, 2),
            buffers={"running_var": torch.ones(2), "num_batches_tracked": torch.tensor(0)},
        ),
    ),
    (
        "fg.make_step: per_sample= and buffers=True do not go together.",
        ValueError,
        lambda: fg.make_step(lambda p: 0, fg.adam(), per_sample=fg.identity(), buffers=True),
    ),
    (
        "fg.named_chain: argument 0 must be a (name, transformation) pair, got GradientTransformation",
        TypeError,
        lambda: fg.named_chain(fg.adam()),
    ),
    (
        "fg.named_chain: names must be unique, got ['a', 'a']",
        ValueError,
        lambda: fg.named_chain(("a", fg.adam()), ("a", fg.adam())),
    ),
    (
        "fg.named_chain: argument 1 must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.named_chain(("a", fg.adam()), ("b", rules.zero_fix())),
    ),
    (
        "fg.named_chain.update: got a state that this chain's init did not make (expected a dict with names ['a'], got AdamState)",
        TypeError,
        lambda: fg.named_chain(("a", fg.adam())).update(P, _adam_state()),
    ),
    ("fg.rules.all_zero: atol must be >= 0, got -1.0.", ValueError, lambda: rules.all_zero(-1.0)),
    (
        "fg.rules.replace_zeros: atol must be a real number, got None.",
        TypeError,
        lambda: rules.replace_zeros(0.5, atol=None),
    ),
    # (message fragment, exception type, trigger)
    ("Invalid learning rate: -1.0", ValueError, lambda: fg.adam(lr=-1.0)),
    (
        "Invalid learning rate: Tensor lr must be 1-element (one value), got shape (2,)",
        ValueError,
        lambda: fg.adam(lr=torch.ones(2)),
    ),
    (
        "Invalid learning rate: '0.1'. Use a float, a 0-d tensor, or a schedule",
        TypeError,
        lambda: fg.adam(lr="0.1"),
    ),
    (
        "Invalid betas: (0.9,); expected a pair (beta1, beta2).",
        ValueError,
        lambda: fg.adam(betas=(0.9,)),
    ),
    ("Invalid beta parameter at index 1: 1.0", ValueError, lambda: fg.adamw(betas=(0.9, 1.0))),
    (
        "Invalid beta parameter at index 0: 1.5",
        ValueError,
        lambda: fg.adam(betas=(torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.9))),
    ),
    (
        "Invalid beta parameter at index 0: Tensor beta must be 1-element (one value), got shape (2,).",
        ValueError,
        lambda: fg.adam(betas=(torch.ones(2), torch.tensor(0.9))),
    ),
    (
        "Invalid learning rate: a tensor lr must be floating point (float64 matches "
        "torch.optim exactly), got torch.int64.",
        TypeError,
        lambda: fg.adam(lr=torch.tensor(1)),
    ),
    (
        "Invalid eps_root value: -1.0; expected a float >= 0.",
        ValueError,
        lambda: fg.adam(eps_root=-1.0),
    ),
    (
        "fg.make_step(donate=True): the step runs under a torch.func transform (grad, "
        "vmap, ...), where its results are the transform's outputs",
        ValueError,
        lambda: torch.func.vmap(
            fg.make_step(lambda p, x: (p["w"] * x).sum(), fg.adam(), donate=True)
        )(
            {"w": torch.zeros(2, 3)},
            torch.func.vmap(fg.adam().init)({"w": torch.zeros(2, 3)}),
            torch.ones(2, 3),
        ),
    ),
    ("Invalid epsilon value: -1.0", ValueError, lambda: fg.adam(eps=-1.0)),
    ("Invalid weight_decay value: -1.0", ValueError, lambda: fg.adam(weight_decay=-1.0)),
    (
        "fg.adam.update: expected an AdamState",
        TypeError,
        lambda: fg.adam().update(P, fg.EmptyState()),
    ),
    (
        "fg.adam.update: the state does not fit these gradients",
        KeyError,
        lambda: fg.adam().update({"v": torch.ones(1)}, _adam_state()),
    ),
    (
        "fg.adam needs the parameters (for its weight decay or scale)",
        ValueError,
        lambda: fg.adam(weight_decay=0.1).update(P, _adam_state()),
    ),
    (
        "fg.cosine_decay: decay_steps must be > 0, got 0.",
        ValueError,
        lambda: fg.cosine_decay(1.0, 0),
    ),
    (
        "fg.cosine_decay: alpha must be in [0, 1], got 2.0.",
        ValueError,
        lambda: fg.cosine_decay(1.0, 10, alpha=2.0),
    ),
    (
        "fg.chain: argument 0 must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.chain(rules.zero_fix()),
    ),
    (
        "fg.chain.update: got a state that this chain's init did not make",
        TypeError,
        lambda: fg.chain(fg.adam()).update(P, _adam_state()),
    ),
    (
        "fg.apply_updates: params and updates must have the same names",
        KeyError,
        lambda: fg.apply_updates(P, {}),
    ),
    ("is a list, not a torch.Tensor", TypeError, lambda: fg.adam().init({"w": [1.0]})),
    (
        "'w' has dtype torch.int64; gradients and optimizer states need a real floating-point dtype",
        TypeError,
        lambda: fg.adam().init({"w": torch.ones(1, dtype=torch.long)}),
    ),
    (
        "fg.all_reduce_mean: torch.distributed is not initialized",
        RuntimeError,
        lambda: fg.all_reduce_mean().init(P),
    ),
    ("fg.Groups: group names must be str, got 1.", TypeError, lambda: fg.Groups({1: ["w"]})),
    ("fg.Groups: group 'a' maps to the string 'w'", TypeError, lambda: fg.Groups({"a": "w"})),
    ("fg.Groups: group 'a' is empty", ValueError, lambda: fg.Groups({"a": []})),
    (
        "fg.Groups: parameter 'w' is in both group 'a' and group 'b'",
        ValueError,
        lambda: fg.Groups({"a": ["w"], "b": ["w"]}),
    ),
    (
        "fg.Groups: no group named 'z'. Known groups: ['a']",
        KeyError,
        lambda: fg.Groups({"a": ["w"]})["z"],
    ),
    (
        "fg.Groups.select: no group named ['z']",
        KeyError,
        lambda: fg.Groups({"a": ["w"]}).select("z"),
    ),
    (
        "fg.per_group.init: group 'a' names parameter 'x', which is not in the gradients",
        KeyError,
        lambda: fg.per_group(rules.zero_fix(), {"a": ["x"]}).init(P),
    ),
    (
        "fg.group_by_module: depth must be a positive int, got 0",
        ValueError,
        lambda: fg.group_by_module(SeedModel(), depth=0),
    ),
    (
        "fg.group_by_module: expected an nn.Module or a dict of parameters, got list",
        TypeError,
        lambda: fg.group_by_module([1]),
    ),
    (
        "fg.group_by_module: types= needs the model",
        TypeError,
        lambda: fg.group_by_module(P, types=nn.Linear),
    ),
    (
        "fg.group_by_module: types must be nn.Module subclasses, got <class 'int'>",
        TypeError,
        lambda: fg.group_by_module(SeedModel(), types=int),
    ),
    (
        "fg.adam_state_from_torch was removed (the Adam-only twin of fg.state_from_torch). "
        "Use fg.state_from_torch(tx, optimizer, params)",
        AttributeError,
        lambda: fg.adam_state_from_torch,
    ),
    (
        "fg.adam_state_to_torch was removed (the Adam-only twin of fg.state_to_torch). "
        "Use fg.state_to_torch(tx, state, optimizer, params)",
        AttributeError,
        lambda: fg.adam_state_to_torch,
    ),
    ("fg.load_params: 'weight' is a list, not a Tensor.", TypeError, _load_params_non_tensor),
    (
        "fg.call: expected an nn.Module as first argument, got dict",
        TypeError,
        lambda: fg.call(P, P),
    ),
    (
        "fg.call: 'w' is not a parameter of Linear",
        KeyError,
        lambda: fg.call(nn.Linear(1, 1), P, torch.ones(1, 1)),
    ),
    (
        "fg.add_noise: std must be a number >= 0, got -1.0.",
        ValueError,
        lambda: fg.add_noise(-1.0, 0),
    ),
    (
        "fg.add_noise: seed must be an int in [0, 2**32), got -1.",
        ValueError,
        lambda: fg.add_noise(1.0, -1),
    ),
    (
        "fg.add_noise.update: expected an AddNoiseState, got EmptyState",
        TypeError,
        lambda: fg.add_noise(1.0, 0).update(P, fg.EmptyState()),
    ),
    (
        "fg.skip_if_nonfinite: tx must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.skip_if_nonfinite(rules.zero_fix()),
    ),
    (
        "fg.skip_if_nonfinite.update: expected a SkipIfNonfiniteState, got AdamState",
        TypeError,
        lambda: fg.skip_if_nonfinite(fg.adam()).update(P, _adam_state()),
    ),
    (
        "fg.state_dict: dict keys must be str (not '_type'), got [1].",
        TypeError,
        lambda: fg.state_dict({1: torch.ones(1)}),
    ),
    (
        "fg.state_dict: cannot store a object in a checkpoint",
        TypeError,
        lambda: fg.state_dict({"a": object()}),
    ),
    (
        "fg.load_state_dict: state.count should be a tensor, found dict.",
        TypeError,
        lambda: fg.load_state_dict(
            fg.add_noise(1.0, 0), P, {"_type": "AddNoiseState", "count": {}}
        ),
    ),
    (
        "fg.load_state_dict: the checkpoint does not match tx.init(params): missing (none); unexpected state.extra.",
        KeyError,
        lambda: fg.load_state_dict(
            fg.add_noise(1.0, 0),
            P,
            {"_type": "AddNoiseState", "count": torch.zeros((), dtype=torch.long), "extra": 1},
        ),
    ),
    (
        "fg.load_state_dict: the checkpoint does not match tx.init(params): missing state.count; unexpected (none).",
        KeyError,
        lambda: fg.load_state_dict(fg.add_noise(1.0, 0), P, {"_type": "AddNoiseState"}),
    ),
    (
        "fg.make_step: tx must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.make_step(lambda p: 0, rules.zero_fix()),
    ),
    (
        "fg.make_step: per_sample must be a GradientTransformation (e.g. fg.ghost_clip(1.0), stateless)",
        TypeError,
        lambda: fg.make_step(lambda p: 0, fg.adam(), per_sample=rules.zero_fix()),
    ),
    (
        "fg.per_sample_grads: per-sample gradients need at least one batch tensor",
        ValueError,
        lambda: fg.per_sample_grads(lambda p: 0)(P),
    ),
    (
        "fg.make_step(per_sample=...): batch argument 0 must be a tensor with a leading batch dimension, got Tensor (0-d)",
        TypeError,
        _per_sample_no_batch,
    ),
    (
        "fg.partition: transforms['a'] must be a GradientTransformation (e.g. fg.adam()), got Rule.",
        TypeError,
        lambda: fg.partition({"a": rules.zero_fix()}, {}),
    ),
    (
        "fg.partition: labels must name every parameter exactly",
        KeyError,
        lambda: fg.partition({"a": fg.adam()}, {}).init(P),
    ),
    (
        "fg.partition: labels ['b'] have no transformation",
        KeyError,
        lambda: fg.partition({"a": fg.adam()}, {"w": "b"}).init(P),
    ),
    ("fg.monitor: unknown stats ['x']", ValueError, lambda: fg.monitor({"a": ["w"]}, stats=("x",))),
    (
        "fg.per_group: rule is a GradientTransformation",
        TypeError,
        lambda: fg.per_group(fg.adam(), {"a": ["w"]}),
    ),
    (
        "fg.rules.scale: factor must be a real number, got True.",
        TypeError,
        lambda: rules.scale(True),
    ),
    ("fg.rules.fill: value must be finite, got inf.", ValueError, lambda: rules.fill(float("inf"))),
    (
        "fg.rules.zero_fraction_above: p must be in [0, 1), got 1.5",
        ValueError,
        lambda: rules.zero_fraction_above(1.5),
    ),
    ("fg.rules.norm_above: x must be >= 0, got -1.0", ValueError, lambda: rules.norm_above(-1.0)),
    (
        "fg.rules.clip_norm: max_norm must be > 0, got 0.0.",
        ValueError,
        lambda: rules.clip_norm(0.0),
    ),
    (
        "fg.rules.when: then must be a rule or condition (a callable group -> group), got a int",
        TypeError,
        lambda: rules.when(rules.all_zero(), 3),
    ),
    (
        "must return a dict with the same keys as its input group",
        ValueError,
        lambda: fg.per_group(lambda g: {}, {"a": ["w"]}).update(P, fg.EmptyState()),
    ),
    (
        "Rules must keep each gradient's shape and dtype",
        ValueError,
        lambda: fg.per_group(lambda g: {k: t.double() for k, t in g.items()}, {"a": ["w"]}).update(
            P, fg.EmptyState()
        ),
    ),
    (
        "must return a 0-d bool tensor",
        ValueError,
        lambda: rules.when(lambda g: torch.ones(2, dtype=torch.bool), rules.fill(1.0))(P),
    ),
]


@pytest.mark.parametrize(("fragment", "exc", "trigger"), CASES, ids=[c[0][:50] for c in CASES])
def test_error(fragment, exc, trigger):
    with pytest.raises(exc, match=re.escape(fragment)):
        trigger()


def test_docs_table_is_covered():
    """Each message in docs/errors.md is triggered by a case here or in another test file."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    documented = re.findall(r"^\| `([^`]+)` \|", doc, flags=re.M)
    assert len(documented) > 40
    tests_text = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    missing = [m for m in documented if m not in tests_text]
    assert not missing, f"documented errors with no test: {missing}"
