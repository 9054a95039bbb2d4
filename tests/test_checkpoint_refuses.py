"""Checkpoints refuse what they cannot restore (issue "Correct everywhere", point 5),
in one process (the directory format without a process group, and fg.sharded on a
group of one rank): a model made of a subset of the saved layers, a shard whose
manifest entry was deleted and whose values were then changed, a NaN parameter (also
in the single-file format), and a rank that dies mid-save (a failing collective),
whose error says whether the save was published and which checkpoint is whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import funcgrad as fg
from funcgrad.distributed import _checkpoint as dckpt

D = torch.float64


def three_layers(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)
    ).to(D)


def two_layers(seed: int = 0) -> nn.Module:
    """The first two of three_layers' layers: its names are a subset of those."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)


def trained(model: nn.Module) -> fg.Optimizer:
    opt = fg.Optimizer(model, fg.adamw(lr=1e-2))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 2, dtype=D)).pow(2).sum().backward()
        opt.step()
    return opt


def live(model: nn.Module, opt: fg.Optimizer) -> list[torch.Tensor]:
    state = fg.state_dict(opt.tx_state)
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for v in state.values() if isinstance(v, torch.Tensor)
    ]


def refused(root: Path, model: nn.Module, opt: fg.Optimizer, fragment: str) -> None:
    before = live(model, opt)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        fg.load_checkpoint(root, model, opt)
    for a, b in zip(before, live(model, opt), strict=True):
        assert torch.equal(a, b)  # nothing changed


def test_a_subset_model_is_refused_by_the_directory_format(tmp_path):
    big = three_layers()
    fg.save_checkpoint(tmp_path / "ckpt", big, trained(big))
    small = two_layers(1)
    opt = trained(small)
    refused(
        tmp_path / "ckpt",
        small,
        opt,
        "the checkpoint was saved for another model or transformation; it holds entries this one does not have: model.4.bias, model.4.weight",
    )


def test_a_subset_model_is_refused_with_a_sharded_state(tmp_path, one_rank):
    tx = fg.sharded(fg.adam(lr=1e-2))
    big = fg.params(three_layers())
    fg.save_checkpoint(tmp_path / "ckpt", dict(big), tx.init(dict(big)))
    small = dict(fg.params(two_layers()))
    with pytest.raises(
        ValueError, match=re.escape("it holds entries this one does not have: params.4.bias")
    ):
        fg.load_checkpoint(tmp_path / "ckpt", small, tx)
    # the same model loads
    params, _, _ = fg.load_checkpoint(tmp_path / "ckpt", dict(fg.params(three_layers(1))), tx)
    for k, v in big.items():
        assert torch.equal(params[k], v)


def test_a_shard_dropped_from_the_manifest_is_not_trusted(tmp_path):
    model = three_layers()
    fg.save_checkpoint(tmp_path / "ckpt", model, trained(model))
    sub = tmp_path / "ckpt" / (tmp_path / "ckpt" / "LATEST").read_text().strip()
    manifest = json.loads((sub / "funcgrad-manifest.json").read_text())
    shard = next(f for f in manifest["files"] if f.endswith(".distcp"))
    del manifest["files"][shard]
    (sub / "funcgrad-manifest.json").write_text(json.dumps(manifest))
    data = bytearray((sub / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF  # then tampered with
    (sub / shard).write_bytes(bytes(data))
    other = three_layers(1)
    refused(
        tmp_path / "ckpt",
        other,
        trained(other),
        f"the manifest of {str(sub)!r} does not list {shard}",
    )


def test_a_nan_parameter_is_refused_in_both_formats(tmp_path, one_rank):
    model = three_layers()
    opt = trained(model)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    fg.save_checkpoint(tmp_path / "dir", model, opt)
    other = three_layers(1)
    refused(
        tmp_path / "dir", other, trained(other), "the model's parameter '2.weight' holds NaN or Inf"
    )
    # single file, and a sharded state's directory
    for tx, path in ((fg.adam(), tmp_path / "one.ckpt"), (fg.sharded(fg.adam()), tmp_path / "sh")):
        params = dict(model.named_parameters())
        params = {k: v.detach() for k, v in params.items()}
        fg.save_checkpoint(path, params, tx.init(params))
        with pytest.raises(
            ValueError, match=re.escape("parameter '2.weight' holds NaN or Inf values")
        ):
            fg.load_checkpoint(path, {k: torch.zeros_like(v) for k, v in params.items()}, tx)


@pytest.mark.parametrize("dies", ["before the save", "after publishing"])
def test_a_rank_dying_mid_save_says_what_was_published(tmp_path, monkeypatch, dies):
    """A collective that fails (gloo's 'Connection closed by peer' when a rank dies) is
    simulated on the first or the last of the save's broadcasts."""
    model = three_layers()
    opt = trained(model)
    root = tmp_path / "ckpt"
    fg.save_checkpoint(root, model, opt)
    first = root / (root / "LATEST").read_text().strip()
    real = dckpt._from_rank0
    calls = []

    def failing(obj):
        calls.append(obj)
        if (dies == "before the save" and len(calls) == 1) or (
            dies == "after publishing" and len(calls) == 2
        ):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        return real(obj)

    monkeypatch.setattr(dckpt, "_from_rank0", failing)
    with pytest.raises(RuntimeError) as info:
        fg.save_checkpoint(root, model, opt)
    text = str(info.value)
    assert "a collective failed while saving" in text and "Connection closed by peer" in text
    latest = root / (root / "LATEST").read_text().strip()
    if dies == "before the save":
        assert latest == first
        assert f"this save was not published; {str(first)!r} is the latest whole checkpoint" in text
    else:
        assert latest != first
        assert f"this save was published ({str(latest)!r}, whole: LATEST names it)" in text


def test_torch_state_converters_refuse_a_sharded_state(one_rank):
    """fg.state_from_torch / state_to_torch walk a state with the optimizer states'
    one walker (fg.get_hyperparams' own): a sharded state is refused by both, by name."""
    model = three_layers()
    params = fg.params(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tx = fg.sharded(fg.adam(lr=1e-2))
    state = tx.init(dict(params))
    message = "the state is sharded across ranks (fg.sharded); convert the state of the unsharded"
    with pytest.raises(TypeError, match=re.escape("fg.state_to_torch: " + message)):
        fg.state_to_torch(tx, state, opt, params)
    with pytest.raises(TypeError, match=re.escape("fg.state_from_torch: " + message)):
        fg.state_from_torch(tx, opt, params)


def test_torch_state_converters_find_the_optimizer_where_get_hyperparams_does():
    """An optimizer state nested in a chain inside a NamedTuple, a list and a dict of
    a custom transformation's state: the converters replace it in place and leave the
    rest as it was; equal to torch.optim.SGD's own state after a step."""
    model = three_layers()
    params = fg.params(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    inner = fg.chain(fg.clip_by_global_norm(1.0), fg.sgd(lr=0.1, momentum=0.9))

    def init(p):
        return {"kept": [torch.tensor(7.0), inner.init(p)]}

    def update(g, s, p=None):
        out, new = inner.update(g, s["kept"][1], p)
        return out, {"kept": [s["kept"][0], new]}

    tx = fg.GradientTransformation(init, update)
    state = fg.state_from_torch(tx, opt, params)
    assert fg.get_hyperparams(state) == [{"lr": 0.1, "momentum": 0.9, "dampening": 0.0}]
    assert float(state["kept"][0]) == 7.0
    sgd = state["kept"][1][0][1]  # ChainState((clip state, SGD state))
    assert type(sgd).__name__ == "SGDState"
    for n, p in model.named_parameters():
        assert torch.equal(sgd.momentum_buffer[n], opt.state[p]["momentum_buffer"])
    other = three_layers(1)
    again = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    fg.state_to_torch(tx, state, again, fg.params(other))
    for p, q in zip(again.param_groups[0]["params"], model.parameters(), strict=True):
        assert torch.equal(again.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
