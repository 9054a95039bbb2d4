"""The optimizers of #24 everywhere Adam works: compiled in one graph, ``per_sample=``,
``accumulate``, ``fg.sharded``, checkpoints, migration from and to ``torch.optim``,
half precision, and Muon beside AdamW with ``fg.partition`` (the seed rule first)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from references import (
    assert_one_graph,
    assert_trees_close,
    check_compiles,
    mlp,
    mlp_data,
    mse,
    torch_run,
)
from torch import nn
from torch._dynamo.utils import counters
from workers import shard_workers as sw

import funcgrad as fg

D = torch.float64

MAKERS = {
    "sgd": lambda: fg.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    "rmsprop": lambda: fg.rmsprop(lr=0.01, momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": lambda: fg.adagrad(lr=0.1, lr_decay=0.1, initial_accumulator_value=0.2),
    "lion": lambda: fg.lion(lr=0.01, weight_decay=0.1, mask=lambda n, p: p.ndim > 1),
    "adafactor": lambda: fg.adafactor(lr=0.05, weight_decay=0.1),
    "muon": lambda: fg.muon(lr=0.02),
    "adamax": lambda: fg.adamax(lr=0.01, weight_decay=0.1, mask=lambda n, p: p.ndim > 1),
    # betas=(0.5, 0.7): the rectified branch from the fourth step
    "radam": lambda: fg.radam(0.01, (0.5, 0.7), 1e-8, 0.1, True),
    "adadelta": lambda: fg.adadelta(lr=0.5, rho=0.8, weight_decay=0.1, maximize=True),
    "rprop": lambda: fg.rprop(0.01, (0.4, 1.3), (1e-4, 0.05), maximize=True),
    "nadam": lambda: fg.nadam(0.01, (0.8, 0.9), 1e-8, 0.1, 0.004, True),
    # t0=1: the average moves from the third step
    "asgd": lambda: fg.asgd(
        lr=0.05, lambd=0.1, t0=1, weight_decay=0.1, mask=lambda n, p: p.ndim > 1
    ),
    "sf_adamw": lambda: fg.schedule_free_adamw(lr=0.01, weight_decay=0.1, warmup_steps=2),
    "sf_sgd": lambda: fg.schedule_free_sgd(lr=0.05, momentum=0.8, weight_decay=0.1, r=0.5),
}


def _model_for(name, dtype=D):
    return mlp(dtype, bias=name != "muon")


def _tensors(tree):
    return {k: v.clone() for k, v in tree.items()}


@pytest.mark.parametrize("layout", ["flat", "dict"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_update_compiles_to_one_graph_equal_to_eager(name, layout):
    """aot_eager runs the traced aten ops: equal to the eager step bit for bit, one
    graph, no recompile on a second state."""
    model = _model_for(name)
    tx = MAKERS[name]()
    params = fg.params(model)
    if layout == "dict":
        params = {k: v.detach().clone() for k, v in params.items()}
    x, y = mlp_data()
    g1 = torch.func.grad(mse(model))(params, x, y)
    s0 = tx.init(params)
    _, s1 = tx.update(g1, s0, params)
    g2 = torch.utils._pytree.tree_map(lambda t: 2 * t, g1)  # same layout as g1

    def update(grads, state, params):
        return tx.update(grads, state, params)

    check_compiles(update, (g1, s0, params), (g2, s1, params))


def test_every_optimizer_in_one_inductor_graph_with_the_seed_rule():
    """One compiled step (inductor, fullgraph): the seed rule, then each layer on its
    own optimizer through fg.partition; equal to the eager step, no recompiles."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4)] + [nn.Linear(4, 4) for _ in range(5)] + [nn.Linear(4, 2)]
    model = nn.Sequential(*layers).double()
    names = ["sgd", "rmsprop", "adagrad", "lion", "adafactor", "muon", "adamw"]
    labels = {}
    for n, p in model.named_parameters():
        which = names[int(n.split(".")[0])]
        labels[n] = "adamw" if which == "muon" and p.ndim != 2 else which
    txs = {k: MAKERS[k]() for k in names[:-1]} | {"adamw": fg.adamw(lr=0.01)}
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.partition(txs, labels))
    x, y = torch.randn(8, 3, dtype=D), torch.randn(8, 2, dtype=D)
    eager = fg.make_step(mse(model), tx)
    compiled = fg.make_step(mse(model), tx, compile=True)
    params = _tensors(fg.params(model))
    state = tx.init(params)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):  # each step from the same params and state (the rule jumps at 0)
        p_c, s_c, _ = compiled(_tensors(params), state, x, y)
        params, state, _ = eager(params, state, x, y)
        for n in params:
            # inductor reorders float64 arithmetic (1e-9). Muon's iteration is bfloat16:
            # inductor keeps float32 within each fused kernel where eager rounds after
            # every op, and on a nearly rank-1 momentum (this small model's) the
            # iteration amplifies that rounding in the small directions: O differs by up
            # to 0.5 per entry, compiled as close to the float64 iteration as eager is
            # (test_muon_iteration_compiled_as_accurate_as_eager)
            muon = labels[n] == "muon"
            tol = dict(rtol=0, atol=0.02 * 0.5) if muon else dict(rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(p_c[n], params[n], **tol)
        assert_trees_close(s_c, state, rtol=1e-9, atol=1e-12)
    assert_one_graph()


def _newton_schulz_64(m, coefficients=(3.4445, -4.775, 2.0315), steps=5):
    """Muon's iteration in float64, written out (the reference for its bfloat16 error)."""
    a, b, c = coefficients
    o = m.T if m.shape[0] > m.shape[1] else m
    o = o / o.norm()
    for _ in range(steps):
        gram = o @ o.T
        o = a * o + (b * gram + c * gram @ gram) @ o
    return o.T if m.shape[0] > m.shape[1] else o


@pytest.mark.parametrize("shape", [(4, 4), (8, 3), (3, 8), (64, 32)])
@pytest.mark.parametrize("rank_one", [False, True])
def test_muon_iteration_compiled_as_accurate_as_eager(shape, rank_one):
    """The bfloat16 iteration (torch's), eager and compiled, against the same in
    float64: within 0.06 per entry on a random matrix. On a nearly rank-1 one (a small
    model's momentum) the small singular directions grow ~3.4x per iteration and the
    bfloat16 rounding with them: both within 0.5, measured 0.1-0.35 for eager."""
    from funcgrad.optim._muon import orthogonalize

    gen = torch.Generator().manual_seed(0)
    m = torch.randn(*shape, dtype=D, generator=gen)
    if rank_one:
        m = m[:, :1] @ m[:1, :] + 1e-2 * torch.randn(*shape, dtype=D, generator=gen)
    want = _newton_schulz_64(m)
    eager = orthogonalize(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
    torch._dynamo.reset()
    compiled = torch.compile(orthogonalize, fullgraph=True)(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
    for got in (eager, compiled):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0.5 if rank_one else 0.06)


@pytest.mark.parametrize("name", list(MAKERS))
def test_per_sample_rule_then_optimizer_equals_a_loop(name):
    model = _model_for(name)
    loss = mse(model)
    params = fg.params(model)
    groups = fg.group_by_module(model)
    tx = MAKERS[name]()
    rule = fg.per_group(fg.rules.zero_fix(), groups)
    step = fg.make_step(loss, tx, per_sample=rule)
    x, y = mlp_data()
    start = _tensors(params)
    new, _, _ = step(params, tx.init(params), x, y)
    fixed = []
    for i in range(x.shape[0]):
        g = torch.func.grad(loss)(start, x[i : i + 1], y[i : i + 1])
        fixed.append(rule.update(g, rule.init(start))[0])
    mean = {k: torch.stack([f[k] for f in fixed]).mean(0) for k in start}
    want, _ = tx.update(mean, tx.init(start), start)
    assert_trees_close(new, fg.apply_updates(start, want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(MAKERS))
def test_accumulate_equals_the_optimizer_on_the_mean(name):
    model = _model_for(name)
    params = _tensors(fg.params(model))
    x, y = mlp_data()
    grads = [torch.func.grad(mse(model))(params, x[i::2], y[i::2]) for i in range(2)]
    acc = fg.accumulate(MAKERS[name](), every=2)
    state = acc.init(params)
    u0, state = acc.update(grads[0], state, params)
    assert all((u == 0).all() for u in u0.values())
    u1, state = acc.update(grads[1], state, params)
    tx = MAKERS[name]()
    mean = {k: (grads[0][k] + grads[1][k]) / 2 for k in params}
    want, _ = tx.update(mean, tx.init(params), params)
    assert_trees_close(u1, want, rtol=1e-12, atol=1e-14)


def test_sharded_on_two_ranks_equals_one_process(tmp_path):
    """fg.sharded(optimizer) on 2 gloo ranks (half the batch each) against one process
    on the full batch: Adafactor's norms and column means and Muon's whole-matrix
    iteration are global; fc3.weight (one row) lies all on rank 0."""
    sw.run("optimizers", tmp_path, 2)
    for name in sw.optimizer_txs(sw.model()):
        m = sw.model()
        tx = sw.optimizer_txs(m)[name]
        want, _ = sw.train(m, tx, fg.make_step(sw.loss_fn(m), tx, donate=True), 0, 1)
        for rank in range(2):
            got = torch.load(tmp_path / f"optimizers-rank{rank}.pt", weights_only=False)[name]
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("name", list(MAKERS))
def test_checkpoint_resumes_bit_for_bit(name, tmp_path):
    def steps(params, state, n):
        step = fg.make_step(mse(model), tx)
        x, y = mlp_data()
        for _ in range(n):
            params, state, _ = step(params, state, x, y)
        return params, state

    model = _model_for(name)
    tx = MAKERS[name]()
    start = _tensors(fg.params(model))
    straight, _ = steps(dict(start), tx.init(start), 4)
    half, state = steps(dict(start), tx.init(start), 2)
    fg.save_checkpoint(tmp_path / "c.pt", half, state)
    loaded_p, loaded_s, _ = fg.load_checkpoint(tmp_path / "c.pt", dict(start), tx)
    resumed, _ = steps(loaded_p, loaded_s, 2)
    assert_trees_close(resumed, straight)


@pytest.mark.parametrize(
    ("name", "field", "bad"),
    [
        ("rmsprop", "square_avg", -1.0),
        ("adagrad", "sum", -1.0),
        ("adafactor", "col_var", float("nan")),
        ("sgd", "momentum_buffer", float("inf")),
        ("adamax", "exp_inf", -1.0),
        ("adadelta", "acc_delta", -1.0),
        ("nadam", "exp_avg_sq", -1.0),
        ("asgd", "ax", float("nan")),
        ("sf_adamw", "exp_avg_sq", -1.0),
    ],
)
def test_checkpoint_with_broken_invariants_is_refused(name, field, bad):
    model = _model_for(name)
    tx = MAKERS[name]()
    params = fg.params(model)
    sd = fg.state_dict(tx.init(params))
    first = next(iter(sd[field]))
    sd[field][first].view(-1)[0] = bad
    with pytest.raises(ValueError, match=re.escape(f"state.{field}['{first}'] holds")):
        fg.load_state_dict(tx, params, sd)


TORCH_TWINS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.1, initial_accumulator_value=0.2)),
    "adafactor": (torch.optim.Adafactor, dict(lr=0.05, weight_decay=0.1)),
    "muon": (torch.optim.Muon, dict(lr=0.02)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
    "adamax": (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.1)),
    "radam": (torch.optim.RAdam, dict(lr=0.01, betas=(0.5, 0.7), weight_decay=0.1)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1)),
    "rprop": (torch.optim.Rprop, dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05))),
    "nadam": (
        torch.optim.NAdam,
        dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "asgd": (torch.optim.ASGD, dict(lr=0.05, lambd=0.1, t0=1, weight_decay=0.1)),
}
FG_TWINS = {
    "sgd": fg.sgd, "rmsprop": fg.rmsprop, "adagrad": fg.adagrad, "adafactor": fg.adafactor,
    "muon": fg.muon, "adamw": fg.adamw, "adamax": fg.adamax,
    "radam": fg.radam, "adadelta": fg.adadelta, "rprop": fg.rprop, "nadam": fg.nadam,
    "asgd": fg.asgd,
}  # fmt: skip


@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_migration_from_and_to_torch_optim(name):
    """2 steps in torch.optim, 2 in funcgrad (inside a chain, flat layout), 2 back in
    torch: equal to 6 steps in torch.optim."""
    twin, kw = TORCH_TWINS[name]
    dtype = torch.float32 if name == "muon" else D
    tol = dict(rtol=1e-5, atol=1e-7) if name == "muon" else dict(rtol=1e-10, atol=1e-12)
    model = mlp(dtype, bias=name != "muon")
    ref = copy.deepcopy(model)
    want = torch_run(ref, twin(ref.parameters(), **kw), steps=6)
    opt = twin(model.parameters(), **kw)
    torch_run(model, opt, steps=2)
    tx = fg.chain(fg.identity(), FG_TWINS[name](**kw))
    params = fg.params(model)
    state = fg.state_from_torch(tx, opt, params)
    inner = state.inner_states[1]
    assert int(inner.count) == (1 if name in ("sgd", "muon") else 2)  # no step in torch's
    step = fg.make_step(mse(model), tx, donate=True)
    x, y = mlp_data(dtype)
    for _ in range(2):
        params, state, _ = step(params, state, x, y)
    back = twin(model.parameters(), **kw)
    fg.state_to_torch(tx, state, back, dict(model.named_parameters()))
    got = torch_run(model, back, steps=2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name",
    ["sgd", "rmsprop", "adagrad", "adafactor", "adamax", "radam", "adadelta", "nadam", "asgd"],
)
def test_half_precision_is_computed_in_float32(name, dtype):
    """Each step from the same state: funcgrad on half-precision parameters against
    torch.optim on their float32 copies (state synced through state_to_torch), rounded
    once. Equal within one rounding of the parameter and of each stored slot."""
    twin, kw = TORCH_TWINS[name]
    model = mlp(dtype)
    tx = FG_TWINS[name](**kw)
    params = _tensors(fg.params(model))
    state = tx.init(params)
    x, y = mlp_data(torch.float32)
    for _ in range(3):
        ref = mlp(torch.float32)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(params[n].float())
        # eps1=None is the parameter dtype's epsilon: the float32 copy must use the same
        ref_kw = dict(kw, eps=(torch.finfo(dtype).eps, 1e-3)) if name == "adafactor" else kw
        opt = twin(ref.parameters(), **ref_kw)
        if int(state.count):
            fg.state_to_torch(tx, state, opt, dict(ref.named_parameters()))
        want = torch_run(ref, opt, steps=1)
        g = torch.func.grad(mse(model))(params, x.to(dtype), y.to(dtype))
        g32 = {n: p.grad for n, p in ref.named_parameters()}
        assert_trees_close({k: v.float() for k, v in g.items()}, g32, rtol=1e-2, atol=1e-2)
        updates, state = tx.update({k: g32[k].to(dtype) for k in g}, state, params)
        params = fg.apply_updates(params, updates)
        for k in want:  # one rounding of the value torch computes in float32
            assert params[k].dtype == dtype
            torch.testing.assert_close(
                params[k].float(), want[k].to(dtype).float(), rtol=1e-2, atol=1e-3
            )


def _rule_by_hand(grads, groups):
    """The seed rule on plain tensors (the question's intended rule)."""
    out = dict(grads)
    for names in groups.values():
        group = [grads[n] for n in names]
        if all((g == 0).all() for g in group):
            out.update({n: torch.ones_like(grads[n]) for n in names})
        else:
            out.update({n: torch.where(grads[n] == 0, 0.5, grads[n]) for n in names})
    return out


class TinyLM(nn.Module):
    """An embedding, two hidden matrices (one of them dead: all-zero gradients), a norm
    and a head: Muon for the hidden matrices, AdamW for the rest."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.dead = nn.Linear(8, 8)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + torch.relu(self.hidden(h)) + torch.relu(self.dead(h))
        return self.head(self.norm(h))


def test_muon_with_adamw_by_partition_equals_torch_muon_plus_adamw():
    """The two-liner of docs/optimizers.md, the seed rule before both, against
    torch.optim.Muon on the hidden matrices and AdamW on the rest with the rule by hand."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    tokens = torch.tensor([[1, 2, 3, 2], [4, 1, 1, 0]])

    def loss_of(m):
        return lambda p, t: nn.functional.cross_entropy(
            fg.call(m, p, t[:, :-1]).reshape(-1, 10), t[:, 1:].reshape(-1)
        )

    hidden = {"hidden.weight", "dead.weight"}
    # the two lines:
    labels = {n: "muon" if n in hidden else "adamw" for n, _ in model.named_parameters()}
    opt_tx = fg.partition({"muon": fg.muon(lr=0.02), "adamw": fg.adamw(lr=3e-3)}, labels)

    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), opt_tx)
    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(loss_of(model), tx, donate=True)
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in sorted(hidden)], lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in hidden], lr=3e-3)
    for _ in range(3):
        params, state, _ = step(params, state, tokens)
        for o in (muon, adamw):
            o.zero_grad()
        loss_of(ref)(named, tokens).backward()
        fixed = _rule_by_hand({n: p.grad for n, p in named.items()}, groups)
        for n, p in named.items():
            p.grad = fixed[n]
        muon.step()
        adamw.step()
    for n, p in named.items():
        torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6)
    assert (model.dead.weight != TinyLM().dead.weight).all()  # the all-zero branch moved it


def test_muon_under_vmap_and_grad():
    """vmap over three (params, grads) against a loop, and the derivative of the
    update with respect to a learnable lr (the update is linear in lr: u / lr)."""
    gen = torch.Generator().manual_seed(3)
    p = {"w": torch.randn(3, 4, 5, dtype=D, generator=gen)}
    g = {"w": torch.randn(3, 4, 5, dtype=D, generator=gen)}
    tx = fg.muon(lr=0.02)

    def two_steps(p, g):
        s = tx.init(p)
        u, s = tx.update(g, s, p)
        return tx.update(g, s, fg.apply_updates(p, u))

    got = torch.func.vmap(two_steps)(p, g)
    for i in range(3):
        want = two_steps({"w": p["w"][i]}, {"w": g["w"][i]})
        for a, b in zip(
            torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got), strict=True
        ):
            # batched and single bfloat16 matmuls round differently; the iteration then
            # carries it: within the bfloat16 iteration's own error (0.06 of O, see
            # test_muon_iteration_compiled_as_accurate_as_eager), times lr
            torch.testing.assert_close(b[i], a, rtol=0, atol=0.02 * 0.06)

    one = {"w": p["w"][0]}
    weights = torch.linspace(-1, 2, 20, dtype=D).view(4, 5)

    def weighted(lr):
        t = fg.muon(lr=lr)
        return (t.update({"w": g["w"][0]}, t.init(one), one)[0]["w"] * weights).sum()

    lr = torch.tensor(0.02, dtype=D)
    torch.testing.assert_close(torch.func.grad(weighted)(lr), weighted(lr) / lr, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "name", ["sgd", "rmsprop", "adagrad", "lion", "adamax", "radam", "adadelta", "nadam", "asgd"]
)
def test_eager_donated_step_writing_into_kept_buffers_is_bit_equal(name):
    """Large buffers (>= 32768 entries): the eager donated step writes each result of
    the update into buffers kept from the previous step (funcgrad/optim/_kernel.py's Ops);
    three steps equal the plain step's, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 200), nn.Tanh(), nn.Linear(200, 10)).double()
    x, y = torch.randn(16, 200, dtype=D), torch.randn(16, 10, dtype=D)
    tx = MAKERS[name]()
    plain = fg.make_step(mse(model), tx)
    p_plain = _tensors(fg.params(model))
    s_plain = tx.init(p_plain)
    params = fg.params(model)
    state = tx.init(params)
    donated = fg.make_step(mse(model), tx, donate=True)
    for _ in range(3):
        params, state, _ = donated(params, state, x, y)
        p_plain, s_plain, _ = plain(p_plain, s_plain, x, y)
        assert_trees_close(params, p_plain)
        assert_trees_close(state, s_plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["lion", "muon"])
def test_half_precision_lion_and_muon_in_float32(name, dtype):
    """One step at a time from the same state: funcgrad on half-precision parameters
    against the same step on their float32 copies (Lion: the paper's loop; Muon:
    torch.optim.Muon), the state upcast; equal within one rounding to the dtype."""
    model = mlp(dtype, bias=name != "muon")
    tx = fg.lion(lr=0.01, weight_decay=0.1) if name == "lion" else fg.muon(lr=0.02)
    params = _tensors(fg.params(model))
    state = tx.init(params)
    x, y = mlp_data(dtype)
    for _ in range(3):
        g = torch.func.grad(mse(model))(params, x, y)
        p32 = {k: v.float() for k, v in params.items()}
        g32 = {k: v.float() for k, v in g.items()}
        if name == "lion":
            m32 = {k: v.float() for k, v in state.mu.items()}
            want = {}
            for k in p32:  # the paper's update in float32
                c = torch.sign(0.1 * g32[k] + 0.9 * m32[k])
                want[k] = p32[k] - 0.01 * (c + 0.1 * p32[k])
        else:
            ref = mlp(torch.float32, bias=False)
            named = dict(ref.named_parameters())
            with torch.no_grad():
                for k, p in named.items():
                    p.copy_(p32[k])
                    p.grad = g32[k]
            opt = torch.optim.Muon(ref.parameters(), lr=0.02)
            if int(state.count):
                fg.state_to_torch(tx, state, opt, named)
            opt.step()
            want = {k: p.detach() for k, p in named.items()}
        updates, state = tx.update(g, state, params)
        params = fg.apply_updates(params, updates)
        for k in want:
            assert params[k].dtype == dtype and state[1][k].dtype == dtype
            torch.testing.assert_close(params[k], want[k].to(dtype), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", [n for n in MAKERS if n != "muon"])
def test_grad_through_the_update_equals_finite_differences(name):
    """torch.func.grad through tx.update (from a state two steps in) with respect to the
    gradients and the parameters: the directional derivative equals a central finite
    difference (float64). Muon's bfloat16 iteration: test_muon_under_vmap_and_grad."""
    model = _model_for(name)
    tx = MAKERS[name]()
    params = _tensors(fg.params(model))
    x, y = mlp_data()
    state = tx.init(params)
    for _ in range(2):
        g = torch.func.grad(mse(model))(params, x, y)
        u, state = tx.update(g, state, params)
        params = fg.apply_updates(params, u)
    g = torch.func.grad(mse(model))(params, x, y)
    gen = torch.Generator().manual_seed(3)
    w = {k: torch.randn(v.shape, generator=gen, dtype=D) for k, v in params.items()}
    vg = {k: torch.randn(v.shape, generator=gen, dtype=D) for k, v in params.items()}
    vp = {k: torch.randn(v.shape, generator=gen, dtype=D) for k, v in params.items()}

    def f(grads, ps):
        u, _ = tx.update(grads, state, ps)
        return sum((u[k] * w[k]).sum() for k in u)

    dg, dp = torch.func.grad(f, argnums=(0, 1))(g, params)
    got = sum((dg[k] * vg[k]).sum() + (dp[k] * vp[k]).sum() for k in g)
    h = 1e-6

    def at(s):
        return f({k: g[k] + s * vg[k] for k in g}, {k: params[k] + s * vp[k] for k in g})

    want = (at(h) - at(-h)) / (2 * h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(MAKERS))
def test_compiled_opt_step_writes_the_state_in_place_and_equals_eager(name):
    """torch.compile(opt.step) (dynamo's eager backend: the traced step, cheaply) for
    every optimizer: the eager fg.Optimizer's values over 5 steps and the same state
    tensors after each step (the traced step copies the new state into the old,
    torch_optim._core.written_into)."""
    x, y = mlp_data()
    runs, held = [], []
    torch._dynamo.reset()  # (fg.Optimizer.step's frames of the other cases: the cache limit)
    for compiled in (False, True):
        m = _model_for(name)
        opt = fg.Optimizer(m, MAKERS[name]())
        if name.startswith("sf_"):
            opt.train()
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for _ in range(5):
            opt.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            step()
            if compiled:
                held.append([id(t) for t in torch.utils._pytree.tree_leaves(opt.tx_state)])
        runs.append({k: v.detach().clone() for k, v in m.named_parameters()})
    assert all(ids == held[0] for ids in held[1:]), name
    for k in runs[0]:
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-12, atol=1e-14)
