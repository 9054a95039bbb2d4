"""fg.ghost_clip: per-sample clipping from per-sample norms (funcgrad/step/_ghost.py),
against the vmap path (``per_sample=fg.clip_by_global_norm``) and a Python loop over
samples, in float64, for every layer type it has a rule for, the vmap fallback, tied
weights and a module called twice; eager and compiled (inductor, one graph)."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from references import clipped_loop
from torch import nn
from torch._dynamo.testing import CompileCounter

import funcgrad as fg
from funcgrad.step._ghost import ghost_gradients

C = 0.7  # below most samples' norms here, so most are clipped, some not


class Scaled(nn.Module):
    """A module with a parameter of its own around a child: the vmap fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.inner = nn.Linear(d, d)

    def forward(self, x):
        return self.inner(x) * self.scale


class Positional(nn.Module):
    """A positional embedding on arange (no batch dimension: shared by the samples),
    with as many positions as samples, so only the probe at two batch sizes can tell."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(t, 4)
        self.scale = Scaled(4)  # the fallback, also on a shared input
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        h = self.tok(idx) + self.pos(pos) + self.scale(self.pos(pos))
        return self.head(torch.tanh(h)).mean(1)


class PositionalRow(Positional):
    """GPT-2's and BERT's form: the positional embedding on ``arange(T)[None]``, a
    ``(1, T, d)`` output added to the batch's ``(B, T, d)`` (it failed: the batch went
    in front of the 1, and the sum broadcast to ``(B, B, T, d)``)."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])[None]
        h = self.tok(idx) + self.pos(pos) + self.scale(self.pos(pos))
        return self.head(torch.tanh(h)).mean(1)


class Attention(nn.Module):
    """torch's own attention module (torchvision's ViT is built on it): its own rule;
    with ``need_weights=True`` (the weights are an output) the vmap fallback."""

    def __init__(self, weights: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.weights = weights

    def forward(self, x):
        h, _ = self.attn(x, x, x, need_weights=self.weights)
        return self.head(h).mean(1)


class Tied(nn.Module):
    """Embedding and output head share one weight; the block runs twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.block = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=True)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.head(self.norm(h)).mean(1)


class RelativeAttention(nn.Module):
    """T5Attention's form: the first layer's relative position bias is an embedding on a
    ``(T, T)`` grid, the same for every sample, permuted to ``(1, H, T, T)`` (with the
    batch in front the permute fails) and returned beside the layer's output for the
    next layer to add to its scores."""

    def __init__(self, d: int, heads: int = 2, bias: bool = False) -> None:
        super().__init__()
        self.q, self.v = nn.Linear(d, d), nn.Linear(d, d)
        self.heads = heads
        self.rel = nn.Embedding(5, heads) if bias else None

    def forward(self, x, position_bias=None):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, -1).transpose(1, 2)
        if position_bias is None:
            r = torch.arange(t)
            grid = (r[None, :] - r[:, None]).clamp(-2, 2) + 2
            position_bias = self.rel(grid).permute(2, 0, 1).unsqueeze(0)
        scores = q @ q.transpose(-1, -2) + position_bias
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return x + h, position_bias


class RelativeBias(nn.Module):
    """Two T5-form layers sharing the first one's position bias; ``twice``: the second
    layer calls the first one's bias module too."""

    def __init__(self, d: int = 4, twice: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(9, d)
        self.first, self.second = RelativeAttention(d, bias=True), RelativeAttention(d)
        if twice:
            self.second.rel = self.first.rel
        self.head = nn.Linear(d, 3)

    def forward(self, idx):
        h, bias = self.first(self.tok(idx))
        h, _ = self.second(h, position_bias=None if self.second.rel is not None else bias)
        return self.head(h).mean(1)


class _Tanh(nn.Module):
    """A module with no rule of its own (the vmap fallback), its weight given."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.tanh(nn.functional.linear(x, self.weight))


class Twice(nn.Module):
    """Parameters reached by several calls, every pair of the cross terms' forms: a
    Linear called twice (weight and bias: factors), a LayerNorm and a fallback module
    called twice (per-sample gradients), and one weight shared by an Embedding (indices,
    called twice), a Linear with a bias of its own (factors) and a fallback module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.scale = nn.Linear(5, 5), nn.LayerNorm(5), Scaled(5)
        self.emb = nn.Embedding(5, 5)
        self.head = nn.Linear(5, 5)
        self.head.weight = self.emb.weight
        self.mix = _Tanh(self.emb.weight)

    def forward(self, x):
        h = self.norm(self.lin(x)) + self.emb((x[:, 0] > 0).long())
        h = self.scale(self.norm(self.lin(torch.tanh(h)))) + self.emb((x[:, 1] > 0).long())
        return self.head(self.scale(self.mix(h)))


def _eval_bn(model: nn.Module) -> nn.Module:
    """Eval mode, with running statistics and affine parameters that are not 0 and 1."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def _models():
    """name -> (model, batch maker(generator) -> (x, y), loss kind)."""
    torch.manual_seed(0)
    seq = 5
    out = {
        "mlp": (
            nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4)),
            lambda g: (torch.randn(6, 7, generator=g), torch.randint(0, 4, (6,), generator=g)),
        ),
        # T = 5, in = 2, out = 3: T (in + out) > in out, the per-sample matrix; then
        # in = out = 16: the Gram form
        "sequence": (
            nn.Sequential(
                nn.Linear(2, 3),
                nn.GELU(),
                nn.Linear(3, 16),
                nn.Linear(16, 16),
                nn.Flatten(),
                nn.Linear(16 * seq, 4),
            ),
            lambda g: (torch.randn(6, seq, 2, generator=g), torch.randint(0, 4, (6,), generator=g)),
        ),
        "cnn": (
            nn.Sequential(
                nn.Conv2d(2, 4, 3, padding=1, stride=(1, 2)),
                nn.GroupNorm(2, 4),
                nn.ReLU(),
                nn.Conv2d(4, 3, 2, dilation=2),
                nn.Flatten(),
                nn.Linear(3 * 4 * 1, 4),
            ),
            lambda g: (
                torch.randn(6, 2, 6, 5, generator=g),
                torch.randint(0, 4, (6,), generator=g),
            ),
        ),
        # Cin * kernel >= 64: per-sample weight gradients by one grouped convolution
        "conv2d-grouped": (
            nn.Sequential(
                nn.Conv2d(8, 5, 3, padding=(1, 2), stride=(2, 1), dilation=(1, 2)),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(5 * 3 * 5, 4),
            ),
            lambda g: (
                torch.randn(6, 8, 6, 5, generator=g),
                torch.randint(0, 4, (6,), generator=g),
            ),
        ),
        # Cin * kernel >= 64 but 4 output positions: the unfolded input's Gram form
        "conv2d-few-positions": (
            nn.Sequential(nn.Conv2d(16, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 2 * 2, 4)),
            lambda g: (
                torch.randn(6, 16, 4, 4, generator=g),
                torch.randint(0, 4, (6,), generator=g),
            ),
        ),
        "conv1d-grouped": (
            nn.Sequential(nn.Conv1d(24, 3, 3, padding=1, stride=2), nn.Flatten(), nn.Linear(12, 4)),
            lambda g: (torch.randn(6, 24, 7, generator=g), torch.randint(0, 4, (6,), generator=g)),
        ),
        "conv1d-rmsnorm": (
            nn.Sequential(
                nn.Conv1d(3, 4, 3, padding=2, stride=2),
                nn.Flatten(),
                nn.RMSNorm(20),
                nn.Linear(20, 4),
            ),
            lambda g: (torch.randn(6, 3, 7, generator=g), torch.randint(0, 4, (6,), generator=g)),
        ),
        # eval-mode BatchNorm (its running statistics) and grouped / depthwise
        # convolutions (the samples as groups times the convolution's own)
        "batchnorm-eval-grouped": (
            _eval_bn(
                nn.Sequential(
                    nn.Conv2d(4, 6, 3, padding=1, groups=2),
                    nn.BatchNorm2d(6),
                    nn.Tanh(),
                    nn.Conv2d(6, 6, 3, stride=2, groups=6),  # depthwise
                    nn.Flatten(2),
                    nn.Conv1d(6, 4, 2, groups=2),
                    nn.Flatten(),
                    nn.BatchNorm1d(12),
                    nn.Linear(12, 4),
                )
            ),
            lambda g: (
                torch.randn(6, 4, 5, 6, generator=g),
                torch.randint(0, 4, (6,), generator=g),
            ),
        ),
        "fallback": (
            nn.Sequential(Scaled(5), nn.Tanh(), nn.Linear(5, 4)),
            lambda g: (torch.randn(6, 5, generator=g), torch.randint(0, 4, (6,), generator=g)),
        ),
        "embedding-padding": (
            nn.Sequential(nn.Embedding(7, 4, padding_idx=0), nn.Flatten(), nn.Linear(4 * 5, 4)),
            lambda g: (
                torch.randint(0, 3, (6, 5), generator=g),  # repeats, and padding rows
                torch.randint(0, 4, (6,), generator=g),
            ),
        ),
        "positional-shared": (
            Positional(6),
            lambda g: (
                torch.randint(0, 9, (6, 6), generator=g),
                torch.randint(0, 3, (6,), generator=g),
            ),
        ),
        "positional-row-shared": (
            PositionalRow(6),
            lambda g: (
                torch.randint(0, 9, (6, 6), generator=g),
                torch.randint(0, 3, (6,), generator=g),
            ),
        ),
        # reads out_proj.weight without calling out_proj: a rule of its own, and with
        # need_weights=True the vmap of the whole module
        "multihead-attention": (
            Attention(),
            lambda g: (torch.randn(6, 5, 8, generator=g), torch.randint(0, 3, (6,), generator=g)),
        ),
        "multihead-attention-weights": (
            Attention(weights=True),
            lambda g: (torch.randn(6, 5, 8, generator=g), torch.randint(0, 3, (6,), generator=g)),
        ),
        # the bias module is adopted by the layer that calls it (its vmap fallback)
        "relative-bias-t5-form": (
            RelativeBias(),
            lambda g: (
                torch.randint(0, 9, (6, 5), generator=g),
                torch.randint(0, 3, (6,), generator=g),
            ),
        ),
        "twice-crossed-and-formed": (
            Twice(),
            lambda g: (torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)),
        ),
        "tied-twice-padding": (
            Tied(),
            lambda g: (
                torch.cat(
                    [
                        torch.zeros(6, 1, dtype=torch.long),
                        torch.randint(0, 11, (6, 4), generator=g),
                    ],
                    1,
                ),
                torch.randint(0, 11, (6,), generator=g),
            ),
        ),
    }
    return {k: (m.double(), make) for k, (m, make) in out.items()}


MODELS = _models()


def _loss(model):
    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    return loss


def _refused(model, error, message, x, y):
    """A ghost gradient function on ``model`` raises ``error`` with ``message``."""
    with pytest.raises(error, match=re.escape(message)):
        ghost_gradients(_loss(model), False, C, "mean")(fg.params(model).views(), x, y)


def _loop_reference(model, params, x, y, max_norm):
    """Each sample alone through plain autograd, clipped as clip_norm does, averaged."""
    return clipped_loop(_loss(model), params, x, y, max_norm)


@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_gradients_equal_the_vmap_path_and_a_loop_over_samples(name):
    model, make = MODELS[name]
    params = fg.params(model)
    x, y = make(torch.Generator().manual_seed(1))
    if x.is_floating_point():
        x = x.double()
    # where the vmap fallback reruns most of the model, the step says so (once); Scaled's
    # reruns only its own code (its call of inner returns what it returned)
    heavy = name == "multihead-attention-weights"
    with pytest.warns(UserWarning, match="vmap fallback") if heavy else contextlib.nullcontext():
        ghost, loss, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params.views(), x, y)
    want, norms = _loop_reference(model, params.views(), x, y, C)
    assert ((norms > C).any() and (norms < 1.5 * C).any()) or (norms > C).all()
    for k in want:
        torch.testing.assert_close(ghost[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    vmapped = fg.make_step(_loss(model), fg.sgd(lr=1.0), per_sample=fg.clip_by_global_norm(C))
    p = {k: v.clone() for k, v in params.views().items()}
    new, _, vloss = vmapped(p, fg.sgd(lr=1.0).init(p), x, y)
    for k in want:  # sgd(lr=1): new = p - grads
        torch.testing.assert_close(p[k] - new[k], ghost[k], rtol=1e-10, atol=1e-12, msg=k)
    torch.testing.assert_close(loss, vloss, rtol=1e-12, atol=0)


def _seed_tx(model):
    groups = fg.group_by_module(model)
    return fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))


def _train(model, per_sample, steps=4, compile=False, reduction_sum=False):
    torch.manual_seed(0)
    m = MODELS["mlp"][0] if model is None else model
    params = {k: v.clone() for k, v in fg.params(m).views().items()}
    tx = _seed_tx(m)
    state = tx.init(params)

    def loss(p, x, y):
        out = nn.functional.cross_entropy(
            fg.call(m, p, x), y, reduction="sum" if reduction_sum else "mean"
        )
        return out

    step = fg.make_step(loss, tx, per_sample=per_sample, compile=compile)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 7, generator=g, dtype=torch.float64)
        x[:, 0] = 0.0  # exact zeros in fc1's gradient column: the seed rule fires
        y = torch.randint(0, 4, (6,), generator=g)
        params, state, loss_value = step(params, state, x, y)
        losses.append(loss_value)
    return params, state, torch.stack(losses)


def test_make_step_with_ghost_clip_trains_as_the_vmap_path_with_the_seed_rule():
    """Several Adam steps behind the seed rule (zero_fix per module): float64, 1e-10."""
    want = _train(None, fg.clip_by_global_norm(C))
    got = _train(None, fg.ghost_clip(C))
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=0)


def test_reduction_sum_for_a_loss_summed_over_the_batch():
    want = _train(None, fg.clip_by_global_norm(C), reduction_sum=True)
    got = _train(None, fg.ghost_clip(C, reduction="sum"), reduction_sum=True)
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=0)


def test_ghost_clip_outside_make_step_is_clip_by_global_norm():
    grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    tx = fg.ghost_clip(1.0)
    got, _ = tx.update(grads, tx.init(grads))
    want, _ = fg.clip_by_global_norm(1.0).update(grads, fg.EmptyState())
    assert all(torch.equal(got[k], want[k]) for k in grads)


def test_compiled_ghost_step_equals_eager_in_one_graph_with_inductor():
    """compile=True with inductor (float32 and float64): the eager ghost step's values
    and one graph over 4 steps (CompileCounter counts the frames dynamo compiles)."""
    for dtype, tol in ((torch.float64, dict(rtol=1e-10, atol=1e-12)),
                       (torch.float32, dict(rtol=1e-5, atol=1e-6))):  # fmt: skip
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4)).to(dtype)

        def loss(p, x, y, model=model):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

        runs = []
        for compile in (False, True):
            params = {k: v.clone() for k, v in fg.params(model).views().items()}
            tx = _seed_tx(model)
            state = tx.init(params)
            step = fg.make_step(loss, tx, per_sample=fg.ghost_clip(C), compile=compile)
            g = torch.Generator().manual_seed(3)
            for _ in range(4):
                x = torch.randn(6, 7, generator=g, dtype=dtype)
                y = torch.randint(0, 4, (6,), generator=g)
                params, state, _ = step(params, state, x, y)
            runs.append(params)
        for k in runs[0]:
            torch.testing.assert_close(runs[1][k], runs[0][k], **tol)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = MODELS["mlp"][0]
    tx = _seed_tx(model)
    step = fg.make_step(_loss(model), tx, per_sample=fg.ghost_clip(C),
                        compile={"backend": counter})  # fmt: skip
    params = fg.params(model)
    state = tx.init(params)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(6, 7, generator=g, dtype=torch.float64)
        params, state, _ = step(params, state, x, torch.randint(0, 4, (6,), generator=g))
    assert counter.frame_count == 1


def test_dp_sgd_with_noise_equals_the_vmap_path():
    """fg.add_noise after the clip: the same noise from the same seed on both paths."""
    runs = []
    for per_sample in (fg.clip_by_global_norm(C), fg.ghost_clip(C)):
        model = MODELS["mlp"][0]
        tx = fg.chain(fg.add_noise(C * 0.5 / 6, seed=4), fg.sgd(lr=0.1))
        params = {k: v.clone() for k, v in fg.params(model).views().items()}
        state = tx.init(params)
        step = fg.make_step(_loss(model), tx, per_sample=per_sample)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randn(6, 7, generator=g, dtype=torch.float64)
            params, state, _ = step(params, state, x, torch.randint(0, 4, (6,), generator=g))
        runs.append(params)
    for k in runs[0]:
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-10, atol=1e-12)


def test_frozen_parameters_are_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    model[0].weight.requires_grad_(False)
    params = fg.params(model)
    assert "0.weight" not in params
    x = torch.randn(6, 7, dtype=torch.float64)
    y = torch.randint(0, 4, (6,))
    got, *_ = ghost_gradients(_loss(model), False, C, "mean")(params.views(), x, y)
    want, _ = _loop_reference(model, params.views(), x, y, C)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


def test_two_models_share_the_hook_and_other_modules_are_untouched():
    """The forward hook is in torch's table only during a ghost pass: two ghost steps
    on two models, interleaved, each equal to its own vmap run; a plain forward between
    them gives the module's own output."""
    a, b = MODELS["mlp"][0], MODELS["sequence"][0]
    make_a, make_b = MODELS["mlp"][1], MODELS["sequence"][1]
    g = torch.Generator().manual_seed(7)
    xa, ya = make_a(g)
    xb, yb = make_b(g)
    xa, xb = xa.double(), xb.double()
    fa = ghost_gradients(_loss(a), False, C, "mean")
    fb = ghost_gradients(_loss(b), False, C, "mean")
    pa, pb = fg.params(a).views(), fg.params(b).views()
    got_a, *_ = fa(pa, xa, ya)
    plain = a(xa)
    got_b, *_ = fb(pb, xb, yb)
    with torch.no_grad():
        torch.testing.assert_close(plain, torch.func.functional_call(a, dict(pa), (xa,)))
    for got, (model, p, x, y) in ((got_a, (a, pa, xa, ya)), (got_b, (b, pb, xb, yb))):
        want, _ = _loop_reference(model, p, x, y, C)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


def _global_hooks() -> dict:
    from torch.nn.modules import module

    return {
        "hooks": dict(module._global_forward_hooks),
        "kwargs": dict(module._global_forward_hooks_with_kwargs),
        "pre": dict(module._global_forward_pre_hooks),
    }


def test_the_hook_is_in_torchs_table_only_while_a_ghost_step_runs():
    """The process is as it was after every ghost step: torch's global forward-hook
    table holds funcgrad's tap during the step (seen from inside the loss) and not
    after it, eagerly (fg.make_step, the gradient function alone, a step that raises),
    compiled (one graph over 3 steps: the hook goes in under the same key each call,
    which dynamo's guard on the table needs) and compile="async" (a build in another
    thread). A user's own global hook stays. Before: the first ghost step registered
    a hook for the life of the process (every nn.Module call then ran torch's slow
    hook path: 1.09x on an unrelated 50-layer forward)."""
    mine = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    mine_pre = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        before = _global_hooks()
        model = MODELS["mlp"][0]
        during: list[int] = []

        def loss(p, x, y):
            if not torch.compiler.is_compiling():  # (a list traced grows a guard)
                during.append(len(_global_hooks()["hooks"]))
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

        g = torch.Generator().manual_seed(3)
        batches = [
            (torch.randn(6, 7, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (6,), generator=g))
            for _ in range(3)
        ]  # fmt: skip
        counter = CompileCounter()
        for compile in (False, {"backend": counter}, "async"):
            tx = _seed_tx(model)
            params = {k: v.clone() for k, v in fg.params(model).views().items()}
            state = tx.init(params)
            options: dict = {"compile": compile}
            step = fg.make_step(loss, tx, per_sample=fg.ghost_clip(C), **options)
            for i, (x, y) in enumerate(batches):
                params, state, _ = step(params, state, x, y)
                if compile == "async" and i == 0:  # the build traces a ghost pass
                    assert step.wait_compiled(600)
                assert _global_hooks() == before, (compile, i)
        assert counter.frame_count == 1
        assert during and all(n == len(before["hooks"]) + 1 for n in during), during
        fn = ghost_gradients(loss, False, C, "mean")
        fn(fg.params(model).views(), *batches[0])
        assert _global_hooks() == before
        with pytest.raises(RuntimeError, match="boom"):

            def failing(p, x, y):
                raise RuntimeError("boom")

            ghost_gradients(failing, False, C, "mean")(fg.params(model).views(), *batches[0])
        assert _global_hooks() == before
    finally:
        mine.remove()
        mine_pre.remove()


def test_a_users_own_global_hook_that_changes_outputs_is_differentiated_through():
    """A global forward hook of the user's that rescales every Linear's output,
    registered before any ghost step: the tap runs first, on the module's own output,
    so the ghost gradients equal a per-sample loop over the hooked model. (Appended
    after the user's hook, the zero would have been added to the rescaled output, and
    each layer's norm taken from the wrong output gradient.)"""

    def double(module, args, out):
        return out * 2.0 if isinstance(module, nn.Linear) else None

    model = MODELS["mlp"][0]
    g = torch.Generator().manual_seed(5)
    x, y = MODELS["mlp"][1](g)
    x = x.double()
    mine = nn.modules.module.register_module_forward_hook(double)
    try:
        params = fg.params(model).views()
        got, *_ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
        want, _ = _loop_reference(model, params, x, y, C)
    finally:
        mine.remove()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


def test_train_mode_batchnorm_is_refused_with_the_per_sample_message():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
    step = fg.make_step(_loss(model), fg.sgd(lr=0.1), per_sample=fg.ghost_clip(1.0))
    params = fg.params(model)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "fg.ghost_clip: Per-sample gradients on a model with BatchNorm in train mode"
        ),
    ):
        step(params, fg.sgd(lr=0.1).init(params), torch.randn(5, 4, dtype=torch.float64),
             torch.randint(0, 2, (5,)))  # fmt: skip


def test_eval_batchnorm_grouped_convolutions_and_attention_take_their_own_rules(monkeypatch):
    """Eval-mode BatchNorm (from its running statistics), grouped / depthwise
    convolutions and nn.MultiheadAttention no longer fall back to a vmap of the module
    (they did before); a BatchNorm without
    running statistics (batch statistics in eval mode too) is refused."""
    from funcgrad.step import _ghost, _ghost_layers

    model, make = MODELS["batchnorm-eval-grouped"]
    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(_ghost, "layer_of", lambda c, n: taken.append(real(c, n)) or taken[-1])
    x, y = make(torch.Generator().manual_seed(1))
    ghost_gradients(_loss(model), False, C, "mean")(fg.params(model).views(), x.double(), y)
    assert len(taken) == 6 and not any(isinstance(t, _ghost_layers.Vmapped) for t in taken)
    taken.clear()  # nn.MultiheadAttention(need_weights=False): its own rule too
    model, make = MODELS["multihead-attention"]
    x, y = make(torch.Generator().manual_seed(1))
    ghost_gradients(_loss(model), False, C, "mean")(fg.params(model).views(), x.double(), y)
    assert len(taken) == 2 and not any(isinstance(t, _ghost_layers.Vmapped) for t in taken)
    loose = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False),
                          nn.Linear(6, 2)).double().eval()  # fmt: skip
    _refused(loose, RuntimeError,
             "fg.ghost_clip: BatchNorm1d built with track_running_stats=False normalizes",
             torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 2, (4,)))  # fmt: skip


def test_a_parameter_read_outside_its_module_is_a_clear_error():
    model = nn.Linear(3, 2).double()
    extra = {"temperature": torch.tensor(2.0, dtype=torch.float64)}

    def loss(p, x, y):
        logits = fg.call(model, {k: v for k, v in p.items() if k != "temperature"}, x)
        return nn.functional.cross_entropy(logits / p["temperature"], y)

    params = {**dict(fg.params(model).views()), **extra}
    msg = "fg.ghost_clip: parameters ['temperature'] are not used by any module call"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ghost_gradients(loss, False, 1.0, "mean")(params, torch.randn(4, 3, dtype=torch.float64),
                                                  torch.randint(0, 2, (4,)))  # fmt: skip


def test_a_module_that_does_not_keep_the_batch_first_is_a_clear_error():
    model = nn.Linear(4, 3).double()

    def loss(p, x, y):  # a sequence-first layout: (T, B, D)
        out = fg.call(model, p, x.transpose(0, 1))
        return nn.functional.cross_entropy(out.mean(0), y)

    with pytest.raises(
        ValueError,
        match=re.escape(
            "fg.ghost_clip: a module with trained parameters returned a tensor of shape"
        ),
    ):
        ghost_gradients(loss, False, 1.0, "mean")(
            fg.params(model).views(), torch.randn(5, 3, 4, dtype=torch.float64),
            torch.randint(0, 3, (5,)),
        )  # fmt: skip


class GridBias(nn.Module):
    """The grid embedding called by the root itself, which then reruns whole."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.bias = nn.Embedding(5, 2)
        self.head = nn.Linear(8, 3)

    def grid(self, t: int) -> torch.Tensor:
        r = torch.arange(t)
        return (r[:, None] - r[None, :]).clamp(0, 4)

    def forward(self, idx):
        weights = self.bias(self.grid(idx.shape[1])).permute(2, 0, 1).softmax(-1)
        h = torch.einsum("hts,bsd->bthd", weights, self.tok(idx)).flatten(2)
        return self.head(h).mean(1)


def test_a_shared_grid_the_model_permutes_goes_to_the_module_that_calls_it(monkeypatch):
    """T5's form: with the batch in front, the grid embedding's output breaks the
    permute; the module that calls it adopts it (a vmap fallback over that module,
    whose output keeps the batch first, or leads with the 1 the batch takes: the
    position bias the next layer adds). Equal to a loop over samples (above, in
    MODELS); here which module takes it, and the root adopting it reruns the whole
    model and says so."""
    from funcgrad.step import _ghost, _ghost_layers

    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(_ghost, "layer_of", lambda c, n: taken.append(real(c, n)) or taken[-1])
    model, make = MODELS["relative-bias-t5-form"]
    x, y = make(torch.Generator().manual_seed(1))
    ghost_gradients(_loss(model), False, C, "mean")(fg.params(model).views(), x, y)
    adopters = [lay for lay in taken if "rel.weight" in lay.call.names]
    assert len(adopters) == 1 and adopters[0].call.module is model.first
    assert isinstance(adopters[0], _ghost_layers.Vmapped)
    assert adopters[0].call.lead == (False, True)  # the bias: (1, H, T, T) took the batch

    model = GridBias().double()
    x, y = torch.randint(0, 9, (4, 5)), torch.randint(0, 3, (4,))
    params = fg.params(model).views()
    with pytest.warns(UserWarning, match=re.escape("vmap fallback for the root module")):
        got, _, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
    want, _ = _loop_reference(model, params, x, y, C)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_a_shared_grid_the_loss_permutes_itself_is_refused_naming_the_module():
    """Called by the loss itself, no module can adopt it: funcgrad's error, naming it."""
    model = GridBias().double()

    def loss(p, idx, y):
        table = {"weight": p["bias.weight"]}
        weights = fg.call(model.bias, table, model.grid(idx.shape[1])).permute(2, 0, 1)
        h = torch.einsum("hts,bsd->bthd", weights.softmax(-1), fg.call(model.tok, {
            "weight": p["tok.weight"]}, idx)).flatten(2)  # fmt: skip
        return nn.functional.cross_entropy(fg.call(model.head, {
            "weight": p["head.weight"], "bias": p["head.bias"]}, h).mean(1), y)  # fmt: skip

    with pytest.raises(
        ValueError, match=re.escape("fg.ghost_clip: the module 'bias' runs without the batch")
    ):
        ghost_gradients(loss, False, 1.0, "mean")(
            fg.params(model).views(), torch.randint(0, 9, (4, 5)), torch.randint(0, 3, (4,))
        )


def test_an_adopted_module_called_by_another_module_too_is_refused():
    """Its per-sample gradients come from its adopter's rerun, which would miss the
    other module's use."""
    msg = "fg.ghost_clip: the module Embedding runs without the batch and its output"
    x, y = torch.randint(0, 9, (4, 5)), torch.randint(0, 3, (4,))
    _refused(RelativeBias(twice=True).double(), ValueError, msg, x, y)


def test_a_rerun_module_given_a_transformers_cache_is_refused():
    """A Hugging Face cache the tap pass filled would be filled again by the rerun (a
    stand-in of transformers' class here; tests/integrations/test_hf_ghost.py has T5's)."""
    cache = type("Cache", (), {"__module__": "transformers.cache_utils"})()

    class Cached(Scaled):  # a fallback module (a parameter of its own) taking the cache
        def forward(self, x, cache=None):
            return self.inner(x) * self.scale

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att, self.head = Cached(4), nn.Linear(4, 3)

        def forward(self, x, cache=None):
            return self.head(self.att(x, cache=cache))

    model = Outer().double()

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x, cache=cache), y)

    msg = "fg.ghost_clip: the module 'att' (Cached) has no per-sample rule"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ghost_gradients(loss, False, C, "mean")(
            fg.params(model).views(), torch.randn(4, 4, dtype=torch.float64),
            torch.randint(0, 3, (4,)),
        )  # fmt: skip


def _scaled_embedding(name: str, where: str, buffer: bool) -> type[nn.Embedding]:
    """A stand-in of Hugging Face's scaled word embeddings (Bart's scale a number,
    Gemma's a 0-d buffer cast to the weight's dtype), defined in module ``where``."""

    def __init__(self, rows: int, d: int, scale: float) -> None:
        nn.Embedding.__init__(self, rows, d, padding_idx=0)
        if buffer:
            self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)
        else:
            self.embed_scale = scale

    def forward(self, ids):
        s = self.embed_scale.to(self.weight.dtype) if buffer else self.embed_scale
        return nn.Embedding.forward(self, ids) * s

    body = {"__init__": __init__, "forward": forward, "__module__": where}
    return type(name, (nn.Embedding,), body)


@pytest.mark.parametrize(
    "where, buffer, rule",
    [
        ("transformers.models.bart.modeling_bart", False, "_Embedding"),
        ("transformers.models.gemma.modeling_gemma", True, "_Embedding"),
        ("my_models", True, "Vmapped"),  # not Hugging Face's: its forward is unknown
    ],
)
def test_scaled_word_embeddings_take_the_embedding_rule(where, buffer, rule, monkeypatch):
    """Hugging Face's scaled word embeddings (an nn.Embedding subclass whose forward
    multiplies by embed_scale) take the embedding's rule with the output gradient
    scaled, not the vmap fallback (a vocabulary-sized per-sample gradient); equal to a
    loop over samples."""
    from funcgrad.step import _ghost

    cls = _scaled_embedding("FakeScaledWordEmbedding", where, buffer)
    torch.manual_seed(0)
    model = nn.Sequential(cls(11, 6, 2.5), nn.Flatten(), nn.Linear(30, 3)).double()
    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(
        _ghost, "layer_of", lambda call, n: taken.append(real(call, n)) or taken[-1]
    )
    x = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))
    x[0, :2] = 0  # the padding row: no gradient
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    params = fg.params(model).views()
    ghost, _, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
    want, norms = _loop_reference(model, params, x, y, C)
    assert (norms > C).any()
    for k in want:
        torch.testing.assert_close(ghost[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    assert type(taken[0]).__name__ == rule


def test_a_scaled_word_embedding_compiled_with_inductor_in_one_graph():
    """compile=True with inductor: the eager ghost step's values (float64), one graph,
    with the scale a 0-d buffer (Gemma's form) read inside it. (Cold, dynamo restarts
    this frame's analysis once, from its pass that turns Python scalars into tensors:
    the backend sees an empty graph first, so graphs are counted, not frames.)"""
    from torch._dynamo.utils import counters

    cls = _scaled_embedding("FakeScaledWordEmbedding", "transformers.models.gemma.x", True)
    torch.manual_seed(0)
    model = nn.Sequential(cls(11, 6, 2.5), nn.Flatten(), nn.Linear(30, 3)).double()
    x = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    want = _three_adam_steps(model, x, y, False)
    torch._dynamo.reset()
    counters.clear()
    got = _three_adam_steps(model, x, y, {"backend": "inductor"})
    assert counters["stats"]["unique_graphs"] == 1
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


class Block(nn.Module):
    """A residual block that owns no parameter itself (its children do)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Mix(nn.Module):
    """A child that takes a second tensor by keyword."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, other=None):
        return self.fc(x) + other


class RootViT(nn.Module):
    """timm's VisionTransformer form: the root owns cls_token and pos_embed and uses them
    between its children's calls (patch embedding, dropout, blocks, norm, head); the
    head also reads an entry of cls_token. ``keyword``: one child gets a tensor that
    depends on cls_token by keyword, which the narrow fallback does not tap."""

    def __init__(self, d: int = 8, keyword: bool = False) -> None:
        super().__init__()
        self.patch = nn.Linear(6, d)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, 5, d))
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.mix = Mix(d) if keyword else None
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        h = self.blocks(self.pos_drop(h))
        if self.mix is not None:
            h = self.mix(h, other=self.cls_token.expand(h.shape[0], h.shape[1], -1))
        return self.head(self.norm(h)[:, 0] * self.cls_token[0, 0, :1])


def _root_vit(keyword=False):
    torch.manual_seed(0)
    model = RootViT(keyword=keyword).double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, 6, generator=g, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,), generator=g)


def test_a_parameter_of_the_root_module_reruns_only_the_roots_own_code(monkeypatch):
    """timm's ViT form: the root's fallback reruns only its own code, each call it makes
    returning what it returned (the Vmapped layer is narrow and covers cls_token and
    pos_embed alone: no warning); equal to a loop over samples and the vmap path."""
    from funcgrad.step import _ghost

    model, x, y = _root_vit()
    params = fg.params(model).views()
    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(_ghost, "layer_of", lambda c, n: taken.append(real(c, n)) or taken[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
    root = [lay for lay in taken if lay.call.module is model]
    assert len(root) == 1 and root[0].narrow
    assert sorted(root[0].call.names.values()) == ["cls_token", "pos_embed"]
    assert sum(t.numel() for t in root[0].covered()) == 8 + 5 * 8
    want, norms = _loop_reference(model, params, x, y, C)
    assert (norms > C).any()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    vmapped = fg.make_step(_loss(model), fg.sgd(lr=1.0), per_sample=fg.clip_by_global_norm(C))
    p = {k: v.clone() for k, v in params.items()}
    new, _, _ = vmapped(p, fg.sgd(lr=1.0).init(p), x, y)
    for k in want:
        torch.testing.assert_close(p[k] - new[k], got[k], rtol=1e-10, atol=1e-12, msg=k)


def _three_adam_steps(model, x, y, compile):
    """The parameters after three ghost-clipped Adam steps from the model's own."""
    params = {k: v.clone() for k, v in fg.params(model).views().items()}
    tx = fg.adam(lr=1e-2)
    state = tx.init(params)
    step = fg.make_step(_loss(model), tx, per_sample=fg.ghost_clip(C), compile=compile)
    for _ in range(3):
        params, state, _ = step(params, state, x, y)
    return params


def test_the_narrow_fallback_compiled_with_inductor_in_one_graph():
    """compile=True with inductor: the eager ghost step's values (float64), one frame."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, x, y = _root_vit()
    want = _three_adam_steps(model, x, y, False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    runs = [want, _three_adam_steps(model, x, y, {"backend": counter})]
    assert counter.frame_count == 1
    for k in runs[0]:
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-10, atol=1e-12, msg=k)
    torch._dynamo.reset()


TAIL_VEC_BUG = {"cpp.enable_loop_tail_vec": False} if torch.__version__ < "2.14" else {}
"""torch 2.13's inductor on the CPU scatters the gradient of an embedding on an index
computed in the graph (a clamped grid) into the wrong rows when it vectorizes the
tail of a transposed tile (fixed in 2.14.1; docs/compile-notes.md); without tail
vectorization it is right, so what is tested is funcgrad's graph."""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_adopted_relative_bias_compiled_with_inductor_in_one_graph(dtype):
    """compile=True with inductor on the T5-form model (the adopting layer's vmap
    fallback, its position bias taking the batch in its leading 1): the eager ghost
    step's values, one graph over 3 steps."""
    from torch._dynamo.utils import counters

    model = RelativeBias().to(dtype)
    x, y = MODELS["relative-bias-t5-form"][1](torch.Generator().manual_seed(1))
    want = _three_adam_steps(model, x, y, False)
    torch._dynamo.reset()
    counters.clear()
    runs = [want, _three_adam_steps(model, x, y, {"options": TAIL_VEC_BUG})]
    assert counters["stats"]["unique_graphs"] == 1
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for k in runs[0]:
        torch.testing.assert_close(runs[1][k], runs[0][k], **tol, msg=k)
    assert (runs[0]["first.rel.weight"] != fg.params(model)["first.rel.weight"]).all()
    torch._dynamo.reset()


@pytest.mark.parametrize("keyword", [False, True], ids=["narrow", "whole"])
@pytest.mark.filterwarnings("ignore:fg.ghost_clip. the vmap fallback")
def test_two_threads_rerunning_one_model_and_a_plain_forward_beside_them(keyword):
    """A fallback's eager rerun swaps tensors in the module itself, as fg.call does, and
    takes turns with fg.call's forwards through the same model; the calls the rerun
    makes skip their forwards in its own thread only. Two threads taking ghost steps on
    one model and a third running fg.call forwards all get their single-threaded
    results, and no module of the model holds an attribute of funcgrad's afterwards
    (the user's own instance forward stays theirs). Before: wrong gradients from the
    whole-model fallback (``keyword``), which swapped tensors under another thread's
    fg.call."""
    import threading

    model, x, y = _root_vit(keyword)
    own = model.norm.forward
    model.norm.forward = lambda t: nn.LayerNorm.forward(model.norm, t)  # the user's own
    fn = ghost_gradients(_loss(model), False, C, "mean")
    params = fg.params(model).views()
    xs = [x * (1 + i / 10) for i in range(4)]
    want = [fn(params, xi, y)[0] for xi in xs]
    with torch.no_grad():
        plain = [fg.call(model, params, xi) for xi in xs]
    got: dict = {}

    def ghost(t):
        got[t] = [fn(params, xi, y)[0] for _ in range(3) for xi in xs]

    def forward():
        with torch.no_grad():
            got["plain"] = [fg.call(model, params, xi) for _ in range(30) for xi in xs]

    threads = [threading.Thread(target=f, args=a) for f, a in
               ((ghost, ("a",)), (ghost, ("b",)), (forward, ()))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in "ab":
        for i, g in enumerate(got[t]):
            for k in g:
                torch.testing.assert_close(g[k], want[i % 4][k], rtol=1e-12, atol=0)
    for i, out in enumerate(got["plain"]):
        torch.testing.assert_close(out, plain[i % 4], rtol=0, atol=0)
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == ["norm"]
    del model.norm.forward
    assert model.norm.forward == own


def test_two_threads_finding_adoptions_with_one_fresh_step():
    """The adoptions a ghost step finds (state it keeps between calls) are found by each
    probe on a copy and cached with the plan: two threads calling one fresh step at
    once on the T5-form model, with two input shapes, both get what a step of their own
    gives."""
    import threading

    model = MODELS["relative-bias-t5-form"][0]
    params = fg.params(model).views()
    g = torch.Generator().manual_seed(4)
    inputs = [(torch.randint(0, 9, (4, t), generator=g), torch.randint(0, 3, (4,), generator=g))
              for t in (5, 6)]  # fmt: skip
    want = [ghost_gradients(_loss(model), False, C, "mean")(params, x, y)[0] for x, y in inputs]
    shared = ghost_gradients(_loss(model), False, C, "mean")
    start = threading.Barrier(2)
    got: dict = {}

    def run(i):
        start.wait()
        got[i] = [shared(params, *inputs[(i + k) % 2])[0] for k in range(4)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for k, grads in enumerate(got[i]):
            for name in grads:
                torch.testing.assert_close(grads[name], want[(i + k) % 2][name], rtol=1e-12,
                                           atol=0, msg=name)  # fmt: skip


def test_a_parameter_its_module_calls_and_other_code_reads_is_refused():
    """A tied head written as ``h @ emb.weight.T`` next to ``emb(idx)``: the read is
    outside any call of the embedding, so its share of every sample's gradient would be
    missing (silently, before: 0.08 off the loop's clipped gradient)."""

    class TiedDirect(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)

        def forward(self, idx):
            return torch.tanh(self.mix(self.emb(idx))).mean(1) @ self.emb.weight.T

    model = TiedDirect().double()
    batch = (torch.randint(0, 7, (5, 3)), torch.randint(0, 7, (5,)))
    refused = "fg.ghost_clip: parameter 'emb.weight' is used by the calls of the module"
    with pytest.raises(ValueError, match=re.escape(refused)):
        ghost_gradients(_loss(model), False, C, "mean")(fg.params(model).views(), *batch)
    # compiled: the traced probe watches nothing, so the step probes eagerly first
    step = fg.make_step(_loss(model), fg.sgd(lr=0.1), per_sample=fg.ghost_clip(C),
                        compile={"backend": "eager"})  # fmt: skip
    params = fg.params(model)
    with pytest.raises(ValueError, match=re.escape(refused)):
        step(params, fg.sgd(lr=0.1).init(params), *batch)


def test_a_parameter_no_call_reaches_read_by_a_higher_module_is_refused():
    """Nothing calls ``a.b``; the root reads ``a.b.weight`` directly, but ghost clipping
    takes that parameter's per-sample gradients from the smallest called module holding
    it (``a``, whose own code never reads it): silently zero before, now refused."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b, self.scale = nn.Linear(4, 4, bias=False), nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.head = Holder(), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.a(x) @ self.a.b.weight.T))

    model = Reader().double()
    _refused(model, ValueError,
             "fg.ghost_clip: parameter 'a.b.weight' is read directly by Reader, and no call",
             torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))  # fmt: skip


class _Gate(nn.Module):
    """Multiplies by a tensor it gets from elsewhere (its caller's parameter), not
    through its arguments."""

    def __init__(self, get) -> None:
        super().__init__()
        self.get = get

    def forward(self, x):
        return x * self.get()


def test_a_call_that_reads_its_callers_parameter_makes_the_caller_rerun_whole(monkeypatch):
    """The caller's narrow rerun would miss the gate's use of its parameter (its call
    returns what it returned): the probe sees the read, and the caller's whole subtree
    reruns; equal to a loop over samples."""
    from funcgrad.step import _ghost

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = nn.Parameter(torch.linspace(0.5, 1.5, 4))
            self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
            self.gate = _Gate(lambda: self.g)

        def forward(self, x):
            return self.head(torch.tanh(self.fc(self.gate(x)) + self.g))

    model = Outer().double()
    params = fg.params(model).views()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,))
    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(_ghost, "layer_of", lambda c, n: taken.append(real(c, n)) or taken[-1])
    with pytest.warns(UserWarning, match="vmap fallback for the root module"):
        got, _, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
    assert [t.narrow for t in taken if t.call.module is model] == [False]
    want, _ = _loop_reference(model, params, x, y, C)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_a_root_fallback_that_cannot_be_narrowed_reruns_the_model_and_warns_once():
    """A child given a tensor that depends on the root's parameter by keyword (not
    tapped): the whole model reruns for every sample, still exact, and the step warns
    once, naming the root."""
    model, x, y = _root_vit(keyword=True)
    params = fg.params(model).views()
    step = ghost_gradients(_loss(model), False, C, "mean")
    with pytest.warns(UserWarning, match=re.escape("vmap fallback for the root module")):
        got, _, _, _ = step(params, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, x, y)  # reported once per step
    want, _ = _loop_reference(model, params, x, y, C)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_invalid_arguments():
    with pytest.raises(ValueError, match=re.escape("fg.ghost_clip: max_norm must be > 0")):
        fg.ghost_clip(0.0)
    with pytest.raises(
        ValueError, match=re.escape("fg.ghost_clip: reduction must be 'mean' or 'sum'")
    ):
        fg.ghost_clip(1.0, reduction="none")


def test_compiled_first_in_a_fresh_process():
    """The compiled ghost step as a process's first ghost pass (dynamo guards on the
    thread's tap state, which must exist before the step sets it): one graph, equal
    to the eager ghost step run after it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import torch, torch.nn as nn, funcgrad as fg
        from torch._dynamo.utils import counters
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4)).double()
        def loss(p, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(6, 7, generator=g, dtype=torch.float64),
                 torch.randint(0, 4, (6,), generator=g)) for _ in range(3)]
        out = []
        for compile in (True, False):
            tx = fg.adam(lr=0.01)
            p = {k: v.clone() for k, v in fg.params(model).views().items()}
            s = tx.init(p)
            step = fg.make_step(loss, tx, per_sample=fg.ghost_clip(0.7), compile=compile)
            for x, y in data:
                p, s, _ = step(p, s, x, y)
            out.append(p)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        for k in out[0]:
            torch.testing.assert_close(out[0][k], out[1][k], rtol=1e-10, atol=1e-12)
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_has_aux_returns_the_batch_aux():
    """With has_aux, the loss's aux comes from the batch's forward (not per sample)."""
    model = MODELS["mlp"][0]

    def loss(p, x, y):
        logits = fg.call(model, p, x)
        return nn.functional.cross_entropy(logits, y), logits.argmax(1)

    tx = fg.sgd(lr=0.1)
    params = {k: v.clone() for k, v in fg.params(model).views().items()}
    x = torch.randn(6, 7, dtype=torch.float64)
    y = torch.randint(0, 4, (6,))
    want = model(x).argmax(1)
    step = fg.make_step(loss, tx, has_aux=True, per_sample=fg.ghost_clip(C))
    *_, aux = step(params, tx.init(params), x, y)
    assert torch.equal(aux, want)
