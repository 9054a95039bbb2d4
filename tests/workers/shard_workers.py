"""Worker processes for the fg.sharded tests (spawned, gloo, loopback only).

The model has uneven row counts (padding), a layer whose gradient rows 2-3 are
always zero (ReLU units that never fire), so on 2 ranks rank 1's *shard* of fc1 is
all-zero while fc1 as a whole is not, and a 0-d parameter.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg
from funcgrad.distributed import _split
from funcgrad.distributed import _whole as _shard_checkpoint
from funcgrad.rules import _rule_base
from workers.dist_workers import destroy, spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

STEPS = 6
BATCH = 12  # divisible by 1, 2 and 3 ranks
NAN_STEP = 3  # one batch poisoned with a NaN: skip_if_nonfinite must skip it everywhere


class Net(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, hidden)
        self.fc2 = nn.Linear(hidden, 3)
        self.fc3 = nn.Linear(3, 1)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc3(torch.tanh(self.fc2(h))) * self.temperature


def model(hidden: int = 4) -> Net:
    torch.manual_seed(0)
    m = Net(hidden).double()
    with torch.no_grad():
        m.fc1.bias[2:].fill_(-100.0)  # units 2, 3 never fire: their rows get zero grads
    return m


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        x = torch.randn(BATCH, 2, generator=g, dtype=torch.float64)
        y = torch.randn(BATCH, 1, generator=g, dtype=torch.float64)
        if i == NAN_STEP:
            y[0] = float("nan")
        out.append((x, y))
    return out


def custom_rule(group):
    """A rule of the user's own (not shard-safe): scales by the group's total |g|.

    fc2 has 3 rows: on 2 ranks its rows are split 2 + 1, so this rule on one rank's
    rows would compute another total."""
    total = sum(t.abs().sum() for t in group.values())
    return {k: t / (1.0 + total) for k, t in group.items()}


# A rule of the user's own, declared shard-safe, whose second statistic (clip_norm's
# norm) is of its own intermediate result: fg.sharded must combine it per call. The
# seed rule inside brings fc1 to a norm of about 1.3, under the clip's 2.0; had rank
# 1 filled its rows with 1.0 (deciding on its rows alone), the norm would be ~2.5.
nested_rule = fg.rules.Rule(
    lambda g: fg.rules.clip_norm(2.0)(fg.rules.zero_fix()(g)), "nested", shard_safe=True
)


def make_tx(m: nn.Module, amsgrad: bool = False) -> fg.GradientTransformation:
    groups = fg.group_by_module(m)
    stats = ("zero_fraction", "all_zero", "norm", "any_nonfinite")
    return fg.named_chain(
        ("before", fg.monitor(groups, stats)),  # the raw global gradient
        ("nested", fg.per_group(nested_rule, groups.select("fc1"))),
        ("rules", fg.per_group(fg.rules.zero_fix(rtol=1e-5), groups.select("fc3"))),
        ("custom", fg.per_group(custom_rule, groups.select("fc2"))),
        ("after", fg.monitor(groups, ("norm",))),  # what the rules made of it
        (
            "update",
            fg.skip_if_nonfinite(
                fg.chain(
                    fg.clip_by_global_norm(1.0),
                    fg.adamw(lr=0.05, weight_decay=0.1, amsgrad=amsgrad),
                )
            ),
        ),
    )


def optimizer_txs(m: nn.Module) -> dict[str, fg.GradientTransformation]:
    """One of each optimizer of #24, options on, each inside skip_if_nonfinite (the
    NaN batch). Adafactor sums its norms and column means across ranks; Muon gathers
    each matrix whole (fc3.weight has one row: rank 1 of 2 holds none of it)."""
    labels = {n: "muon" if p.ndim == 2 else "adamw" for n, p in m.named_parameters()}
    txs = {
        "sgd": fg.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
        "rmsprop": fg.rmsprop(lr=0.01, momentum=0.5, centered=True, weight_decay=0.1),
        "adagrad": fg.adagrad(lr=0.1, lr_decay=0.1, initial_accumulator_value=0.1),
        "lion": fg.lion(lr=0.01, weight_decay=0.1),
        "adafactor": fg.adafactor(lr=0.05, weight_decay=0.1),
        "adamax": fg.adamax(lr=0.01, weight_decay=0.1, maximize=True),
        "nadam": fg.nadam(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
        "asgd": fg.asgd(lr=0.05, lambd=0.1, t0=1, weight_decay=0.1),
        "sf_adamw": fg.schedule_free_adamw(lr=0.01, weight_decay=0.1, warmup_steps=2),
        "radam": fg.radam(lr=0.01, betas=(0.5, 0.7), weight_decay=0.1),
        "adadelta": fg.adadelta(lr=0.5, weight_decay=0.1),
        "rprop": fg.rprop(lr=0.01, etas=(0.4, 1.3)),
        "muon": fg.partition({"muon": fg.muon(lr=0.02), "adamw": fg.adamw(lr=0.01)}, labels),
    }
    return {k: fg.skip_if_nonfinite(tx) for k, tx in txs.items()}


def loss_fn(m: nn.Module):
    def loss(p, x, y):
        return ((fg.call(m, p, x) - y) ** 2).mean()

    return loss


ROWS = "+rows"
"""A mode ending in this runs on a plain dict of the parameters: fg.sharded splits
them by rows instead of in flat chunks."""


CAPPED = "+capped"
"""A mode ending in this caps the CPU buffers at 12 float64 entries: fg.params(model())
is then four buffers of one dtype, fc2 split across two of them (ruled per tensor)."""


def params_for(m: nn.Module, mode: str = ""):
    return dict(fg.params(m)) if mode.endswith(ROWS) else fg.params(m)


def train(m, tx, step, rank, world, steps=range(STEPS), params=None, state=None, mode=""):
    params = params_for(m, mode) if params is None else params
    state = tx.init(params) if state is None else state
    n = BATCH // world
    data = batches()
    for i in steps:
        x, y = data[i]
        step(params, state, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    return params, state


# ---- real architectures (examples/): a small GPT with tied weights and masked AdamW,
# and a ResNet with train-mode BatchNorm (buffers=True). Eager, float64, 3 steps.


def small_gpt(mask_as_dict: bool = False) -> tuple[nn.Module, fg.GradientTransformation]:
    """examples/char_gpt.py's model (float64, vocabulary 11) and its transformation:
    per-block rule + monitor + AdamW(mask=decays). ``mask_as_dict``: the same mask as
    a dict of names (fg.sharded then splits flat chunks; a predicate means rows)."""
    import char_gpt

    torch.manual_seed(0)
    m = char_gpt.CharGPT(vocab=11, block=8, dim=16, layers=2, heads=2, dropout=0.0).double()
    groups = fg.group_by_module(m, depth=2)
    mask = char_gpt.decays
    if mask_as_dict:
        mask = {k: char_gpt.decays(k, p) for k, p in fg.params(m).items()}
    tx = fg.chain(
        fg.monitor(groups),
        fg.per_group(fg.rules.zero_fix(atol=1e-12), groups),
        fg.adamw(lr=1e-2, weight_decay=0.1, mask=mask),
    )
    return m, tx


def gpt_run(
    rank: int, world: int, sharded: bool = True, mask_as_dict: bool = False
) -> dict[str, torch.Tensor]:
    """The small GPT, a few steps, each rank on its part of the batch."""
    m, tx = small_gpt(mask_as_dict)
    tx = fg.sharded(tx) if sharded else tx

    def loss(p, idx, tgt):
        logits = fg.call(m, p, idx)
        return nn.functional.cross_entropy(logits.reshape(-1, 11), tgt.reshape(-1))

    step = fg.make_step(loss, tx, donate=True)
    params = fg.params(m)
    state = tx.init(params)
    if sharded:
        split = type(type(state).layout.ranks).__name__
        assert split == ("Chunks" if mask_as_dict else "Ranks"), split
    g = torch.Generator().manual_seed(2)
    n = 6 // world
    for _ in range(3):
        idx = torch.randint(0, 11, (6, 9), generator=g)
        mine = idx[rank * n : (rank + 1) * n]
        step(params, state, mine[:, :-1], mine[:, 1:])
    return {k: v.clone() for k, v in params.items()}


def resnet_run(rank: int, world: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """examples/resnet_digits.py's model with train-mode BatchNorm (buffers=True): each
    rank normalizes by its own half of the batch, so the reference is data parallelism
    with replicated state (fg.all_reduce_mean), not one process."""
    import resnet_digits

    torch.manual_seed(0)
    m = resnet_digits.ResNet(width=4).double()
    groups = fg.group_by_module(m, types=(nn.Conv2d, nn.Linear))
    rule_adam = [
        fg.per_group(fg.rules.zero_fix(), groups),
        fg.adamw(lr=1e-2, weight_decay=0.1, mask=resnet_digits.decays),
    ]
    tx = (
        fg.sharded(fg.chain(*rule_adam))
        if kind == "sharded"
        else fg.chain(fg.all_reduce_mean(), *rule_adam)
    )

    def loss(p, b, x, y):
        return nn.functional.cross_entropy(fg.call(m, p, x, buffers=b), y)

    step = fg.make_step(loss, tx, donate=True, buffers=True)
    params, bufs = fg.params(m), fg.buffers(m)
    state = tx.init(params)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (8,), generator=g)
        n = 8 // world
        step(params, state, bufs, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    return {"params": dict(params), "buffers": dict(bufs)}


class HalfNet(nn.Module):
    """Parameters in three dtypes (two of them 2-byte), each buffer of odd length: fg.params
    gives one buffer per dtype, each split in chunks with padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 5).to(torch.bfloat16)  # 15 entries
        self.b = nn.Linear(3, 3, bias=False)  # float32, 9 entries
        self.c = nn.Linear(2, 3).to(torch.float16)  # 9 entries, its gradient all zero


def half_grads(m: nn.Module) -> dict[str, torch.Tensor]:
    """Per parameter, multiples of 1/8 in [-1, 1] (a third of them zero; all of c's):
    times 1, 2 or 3 they stay exact in bfloat16, so the mean over 2 ranks of G * 1 and
    G * 3 is exactly one process's G * 2."""
    g = torch.Generator().manual_seed(4)
    out = {}
    for k, p in m.named_parameters():
        q = torch.randint(-8, 9, p.shape, generator=g) * (torch.rand(p.shape, generator=g) > 0.33)
        out[k] = (q / 8).to(p.dtype) * (not k.startswith("c."))
    return out


def half_run(rank: int, world: int, sharded: bool) -> dict:
    """HalfNet, 3 steps of the seed rule per layer + Adam (eager, donated), each rank's
    loss sum(p * G) * mean(x) with mean(x) = 1 on rank 0 and 3 on rank 1 (2 on the full
    batch): every gradient, and so every result, is exact in the parameters' dtypes."""
    torch.manual_seed(0)
    m = HalfNet()
    G = half_grads(m)
    tx = fg.chain(
        fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam(lr=0.1, eps=1e-3)
    )
    tx = fg.sharded(tx) if sharded else tx

    def loss(p, x):
        return sum((p[k].float() * G[k].float()).sum() for k in G) * x.mean()

    step = fg.make_step(loss, tx, donate=True)
    params = fg.params(m)
    state = tx.init(params)
    x = torch.tensor([1.0, 1.0, 3.0, 3.0])
    n = 4 // world
    for _ in range(3):
        step(params, state, x[rank * n : (rank + 1) * n])
    saved = fg.state_dict(state)
    return {
        "split": type(type(state).layout.ranks).__name__ if sharded else None,
        "buffers": [b.dtype for b in params.buffers],
        "params": {k: v.clone() for k, v in params.items()},
        "state": dict(fg.core._tree.tensor_paths(_shard_checkpoint.full_tensors(saved))),
    }


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for _, t in fg.core._tree.tensor_paths(state))


def worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=5 if mode == "stall" else 120)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    result: dict = {}
    try:
        if mode == "stall" and rank == 1:
            time.sleep(3600)
        if mode == "mismatch_model":
            m = model(hidden=5 if rank == 1 else 4)
            fg.sharded(make_tx(m)).init(fg.params(m))
        if mode == "mismatch_values":
            m = model()
            with torch.no_grad():
                m.fc2.bias.add_(float(rank))
            fg.sharded(make_tx(m)).init(fg.params(m))
        if mode == "mismatch_tx":
            m = model()
            fg.sharded(make_tx(m, amsgrad=rank == 2)).init(fg.params(m))
        layout, mode = mode, mode.removesuffix(ROWS)  # layout: the mode as given
        if mode.endswith(CAPPED):
            fg.core._layout.CPU_BUCKET_BYTES = 12 * 8
            mode = mode.removesuffix(CAPPED)
        if mode == "per_shard":  # statistics NOT combined: each rank decides on its part
            _split.Cut.any = lambda self, flag: flag  # type: ignore[method-assign]
            _split.Cut.batched = lambda self, fn: fn()  # type: ignore[method-assign]
        if mode == "nested_batched":  # the nested rule's statistics in one collective
            _rule_base.reads_input_only = _rule_base.is_shard_safe
        if mode == "custom_on_shards":  # the custom rule run on rows, not the whole group
            _rule_base.is_shard_safe = lambda fn: True
        if mode == "architectures":
            result["gpt"] = gpt_run(rank, world)
            result["gpt_chunks"] = gpt_run(rank, world, mask_as_dict=True)
            result["resnet"] = {
                kind: resnet_run(rank, world, kind) for kind in ("sharded", "replicated")
            }
            torch.save(result, Path(out) / f"{mode}-rank{rank}.pt")
            dist.barrier()
            return
        if mode == "accumulate":  # fg.accumulate inside and outside fg.sharded
            for where in ("inside", "outside"):
                m = model()
                tx = (
                    fg.sharded(fg.accumulate(make_tx(m), 2))
                    if where == "inside"
                    else fg.accumulate(fg.sharded(make_tx(m)), 2)
                )
                step = fg.make_step(loss_fn(m), tx, donate=True)
                params, _ = train(m, tx, step, rank, world)
                result[where] = {k: v.clone() for k, v in params.items()}
            torch.save(result, Path(out) / f"{mode}-rank{rank}.pt")
            dist.barrier()
            return
        if mode == "half":  # flat chunks of bfloat16 / float16 / float32 buffers
            torch.save(half_run(rank, world, True), Path(out) / f"{mode}-rank{rank}.pt")
            dist.barrier()
            return
        if mode == "optimizers":  # every optimizer of #24 under fg.sharded, eager
            for name in optimizer_txs(model()):
                m = model()
                tx = fg.sharded(optimizer_txs(m)[name])
                step = fg.make_step(loss_fn(m), tx, donate=True)
                params, _ = train(m, tx, step, rank, world)
                result[name] = {k: v.clone() for k, v in params.items()}
            torch.save(result, Path(out) / f"{mode}-rank{rank}.pt")
            dist.barrier()
            return
        if mode == "raise":
            m = model()
            tx = fg.sharded(make_tx(m))
            params = fg.params(m)
            state = tx.init(params)
            if rank == 1:
                raise RuntimeError("rank 1 failed on purpose")
            x, y = batches()[0]
            fg.make_step(loss_fn(m), tx, donate=True)(params, state, x[:6], y[:6])
        backend = "inductor" if mode == "compiled_inductor" else "aot_eager"
        compile: bool | dict = False
        if mode.startswith("compiled"):
            compile = {"backend": backend}
        elif mode == "gradients":  # the gradients compiled, the sharded tx eager
            compile = {"backend": backend, "scope": "gradients"}
        m = model()
        tx = fg.sharded(make_tx(m))
        step = fg.make_step(loss_fn(m), tx, compile=compile, donate=True)
        counters.clear()
        if mode == "save":
            params, state = train(m, tx, step, rank, world, range(NAN_STEP + 1), mode=layout)
            fg.save_checkpoint(os.path.join(out, "ckpt"), params, state, step=NAN_STEP + 1)
            result["saved_state"] = _shard_checkpoint.full_tensors(fg.state_dict(state))
            params, state = train(
                m, tx, step, rank, world, range(NAN_STEP + 1, STEPS), params, state
            )
        elif mode == "load":
            params = params_for(m, layout)
            params, state, extra = fg.load_checkpoint(os.path.join(out, "ckpt"), params, tx)
            assert extra == {"step": NAN_STEP + 1}
            result["loaded_state"] = _shard_checkpoint.full_tensors(fg.state_dict(state))
            params, state = train(
                m, tx, step, rank, world, range(NAN_STEP + 1, STEPS), params, state
            )
        else:
            params, state = train(m, tx, step, rank, world, mode=layout)
        result.update(
            split=type(type(state).layout.ranks).__name__,
            buffers=[list(m) for m in params.layout.members] if hasattr(params, "layout") else None,
            params={k: v.clone() for k, v in params.items()},
            monitor={
                name: {g: dict(s) for g, s in state.inner[name].stats.items()}
                for name in ("before", "after")
            },
            skipped=int(state.inner["update"].skipped),
            state_bytes=state_bytes(state),
            graphs=counters["stats"]["unique_graphs"],
            breaks=sum(counters["graph_break"].values()),
        )
        torch.save(result, Path(out) / f"{layout}-rank{rank}.pt")
        dist.barrier()
    finally:
        destroy(rank, out)


def run(mode: str, out: Path, world: int, deadline_s: float = 240.0) -> float:
    return spawn(worker, mode, out, world, deadline_s)
