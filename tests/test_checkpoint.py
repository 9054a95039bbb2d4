"""fg.save_checkpoint / fg.load_checkpoint: resume bit for bit; damaged, partial or
foreign checkpoints are clear errors that leave the live params and state intact."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from references import SeedModel, assert_trees_close, seed_loss

import funcgrad as fg


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = SeedModel()
    groups = fg.group_by_module(model)
    tx = fg.named_chain(
        ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
        ("adam", fg.skip_if_nonfinite(fg.adamw(lr=1e-2, amsgrad=True))),
    )
    step = fg.make_step(seed_loss(model), tx, donate=True)
    params = fg.params(model)
    return model, tx, step, params, tx.init(params)


def batch(i: int) -> torch.Tensor:
    return torch.rand(3, 1, generator=torch.Generator().manual_seed(i))


def snapshot(tree):
    return torch.utils._pytree.tree_map(lambda t: t.clone(), tree)


def test_resume_from_a_checkpoint_is_bit_for_bit(tmp_path):
    _, _, step, params, state = setup()
    for i in range(6):
        params, state, _ = step(params, state, batch(i))
    want = snapshot((params, state))

    _, _, step, params, state = setup()
    for i in range(3):
        params, state, _ = step(params, state, batch(i))
    fg.save_checkpoint(tmp_path / "ckpt.fg", params, state, epoch=3, note="half way")
    model2, tx2, step2, params2, _ = setup(seed=1)  # another initialisation
    params2, state2, extra = fg.load_checkpoint(tmp_path / "ckpt.fg", params2, tx2)
    assert extra == {"epoch": 3, "note": "half way"}
    assert params2["fc1.weight"].data_ptr() == model2.fc1.weight.data_ptr()  # live module
    for i in range(3, 6):
        params2, state2, _ = step2(params2, state2, batch(i))
    assert_trees_close((params2, state2), want)


def test_the_old_argument_order_loads_the_same_with_a_deprecation_warning(tmp_path):
    """load_checkpoint takes save_checkpoint's order, (path, params, tx); the order of
    earlier releases, (path, tx, params) and (path, opt, model), still loads the same,
    with a DeprecationWarning that names the new order."""
    _, _, step, params, state = setup()
    for i in range(2):
        params, state, _ = step(params, state, batch(i))
    fg.save_checkpoint(tmp_path / "ckpt.fg", params, state)
    _, tx_new, _, p_new, _ = setup(seed=1)
    _, s_new, _ = fg.load_checkpoint(tmp_path / "ckpt.fg", p_new, tx_new)
    _, tx_old, _, p_old, _ = setup(seed=2)
    with pytest.warns(
        DeprecationWarning,
        match=re.escape(
            "fg.load_checkpoint(path, tx, params) is the argument order of earlier releases; write fg.load_checkpoint(path, params, tx)"
        ),
    ):
        _, s_old, _ = fg.load_checkpoint(tmp_path / "ckpt.fg", tx_old, p_old)
    assert_trees_close((p_old, s_old), (p_new, s_new), rtol=0, atol=0)
    assert_trees_close(p_new, params, rtol=0, atol=0)

    model = torch.nn.Linear(2, 1)
    opt = fg.Optimizer(model, fg.adam(lr=1e-2))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    fg.save_checkpoint(tmp_path / "dir", model, opt)
    with pytest.warns(
        DeprecationWarning, match=re.escape("write fg.load_checkpoint(path, model, opt)")
    ):
        got, got_opt, _ = fg.load_checkpoint(tmp_path / "dir", opt, model)
    assert got is model and got_opt is opt


@pytest.fixture
def saved(tmp_path):
    """A good checkpoint on disk, and a live run whose params/state differ from it."""
    _, tx, step, params, state = setup()
    params, state, _ = step(params, state, batch(0))
    path = tmp_path / "ckpt.fg"
    fg.save_checkpoint(path, params, state)
    params, state, _ = step(params, state, batch(1))
    return path, tx, params, state


def _assert_refused(path, tx, params, state, exc, message):
    before = snapshot((params, state))
    on_disk = path.read_bytes() if path.exists() else None
    with pytest.raises(exc, match=re.escape(message)):
        fg.load_checkpoint(path, params, tx)
    assert_trees_close((params, state), before)  # nothing touched
    if on_disk is not None:
        assert path.read_bytes() == on_disk


def test_a_flipped_byte_is_an_error(saved):
    path, tx, params, state = saved
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _assert_refused(
        path, tx, params, state, ValueError, "is damaged: its SHA-256 checksum does not match"
    )


def test_a_truncated_file_is_an_error(saved):
    path, tx, params, state = saved
    path.write_bytes(path.read_bytes()[:-100])
    _assert_refused(
        path, tx, params, state, ValueError, "is damaged: its SHA-256 checksum does not match"
    )


def test_a_file_that_is_not_a_checkpoint_is_an_error(saved, tmp_path):
    _, tx, params, state = saved
    other = tmp_path / "other.pt"
    torch.save({"w": torch.ones(1)}, other)
    _assert_refused(
        other, tx, params, state, ValueError, "is not a checkpoint written by fg.save_checkpoint"
    )


def test_a_checkpoint_of_another_transformation_is_an_error(saved):
    path, _, params, state = saved
    other_tx = fg.chain(fg.adam())
    _assert_refused(
        path,
        other_tx,
        params,
        state,
        TypeError,
        "fg.load_state_dict: state should be a ChainState, found dict",
    )


def test_a_checkpoint_of_another_model_is_an_error(saved):
    path, tx, params, state = saved
    bigger = dict(params)
    bigger["fc4.weight"] = torch.zeros(1, 1)
    _assert_refused(
        path,
        tx,
        bigger,
        state,
        KeyError,
        "fg.load_checkpoint: the checkpoint's parameters are not these: it has missing ['fc4.weight']",
    )


def test_extras_that_cannot_be_loaded_safely_are_refused_at_save(tmp_path):
    _, _, _, params, state = setup()
    with pytest.raises(
        TypeError, match=re.escape("fg.save_checkpoint: extra values must be numbers")
    ):
        fg.save_checkpoint(tmp_path / "x.fg", params, state, model=SeedModel())
    assert not list(tmp_path.iterdir())  # nothing written, no temporary file left


SAVER = """
import sys, torch, funcgrad as fg
path, n = sys.argv[1], int(sys.argv[2])
params = {"w": torch.zeros(n)}
state = fg.adam().init(params)
print("ready", flush=True)
i = 0
while True:
    i += 1
    fg.save_checkpoint(path, {"w": torch.full((n,), float(i))}, state, i=i)
    print("saved", i, flush=True)
"""


def test_a_save_killed_midway_keeps_a_whole_checkpoint(tmp_path):
    """A process saving 40 MB checkpoints in a loop, killed at random moments: the
    file at the path always loads, with matching params and extra.

    Each kill comes a while after the process reported a finished save, so it lands
    in a later write (a save took 0.3 s to over 1.4 s on these shared cores: fixed
    delays from start alone once saw no save finish in four trials)."""
    path = tmp_path / "ckpt.fg"
    tx = fg.adam()
    n = 10_000_000
    fg.save_checkpoint(path, {"w": torch.zeros(n)}, tx.init({"w": torch.zeros(n)}), i=0)
    loaded_i = []
    for trial in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(n)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().startswith("saved")  # one save finished
        time.sleep(0.05 + 0.37 * trial)
        proc.kill()  # SIGKILL: no cleanup, possibly mid-write
        proc.wait()
        params = {"w": torch.empty(n)}
        params, _, extra = fg.load_checkpoint(path, params, tx)
        assert torch.all(params["w"] == float(extra["i"]))
        loaded_i.append(extra["i"])
    assert max(loaded_i) > 0  # saves did complete between kills
    leftovers = [p for p in Path(tmp_path).iterdir() if p.name != "ckpt.fg"]
    assert all(p.suffix == ".tmp" for p in leftovers)  # a kill mid-write leaves only these


def test_a_save_interrupted_after_writing_keeps_the_previous_file(tmp_path, monkeypatch):
    """Deterministic twin of the kill test: the save is interrupted after the new
    bytes are written but before the rename; the old checkpoint stays, whole."""
    import os

    path = tmp_path / "ckpt.fg"
    tx = fg.adam()
    fg.save_checkpoint(path, {"w": torch.zeros(3)}, tx.init({"w": torch.zeros(3)}), i=1)
    before = path.read_bytes()

    def crash(fd):
        raise KeyboardInterrupt  # as if the process were stopped here

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        fg.save_checkpoint(path, {"w": torch.ones(3)}, tx.init({"w": torch.ones(3)}), i=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.fg"]  # the temporary file removed
    params, _, extra = fg.load_checkpoint(path, {"w": torch.empty(3)}, tx)
    assert extra == {"i": 1} and torch.equal(params["w"], torch.zeros(3))


def _adam_sd(**broken):
    params = {"w": torch.zeros(2)}
    sd = fg.state_dict(fg.adam().init(params))
    for key, value in broken.items():
        if key == "count":
            sd["count"] = value
        else:
            sd[key]["w"] = value
    return params, sd


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            {"mu": torch.tensor([0.0, float("nan")])},
            "state.mu['w'] holds NaN or Inf values, which a AdamState never does",
        ),
        ({"nu": torch.tensor([0.0, -1.0])}, "state.nu['w'] holds negative values"),
        ({"count": torch.tensor(-3)}, "state.count holds negative values"),
    ],
)
def test_load_state_dict_checks_the_invariants(broken, message):
    params, sd = _adam_sd(**broken)
    with pytest.raises(ValueError, match=re.escape(message)):
        fg.load_state_dict(fg.adam(), params, sd)


# ---- the directory (distributed) format in one process: a model and its fg.Optimizer


def _model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    m = m.double()
    return m, fg.Optimizer(m, fg.adamw(lr=1e-2, weight_decay=0.1))


def _train(m, opt, steps):
    for i in range(steps):
        opt.zero_grad()
        m(torch.full((4, 2), float(i + 1), dtype=torch.float64)).pow(2).sum().backward()
        opt.step()


def _live(m, opt):
    out = {f"p {k}": v.detach().clone() for k, v in m.named_parameters()}
    state = fg.state_dict(opt.tx_state)
    out.update({f"s {k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out, repr(state)


def test_a_model_and_its_optimizer_resume_bit_for_bit_from_a_directory(tmp_path):
    """In one process (no process group): two saves, the older removed, the resumed run
    equals the uninterrupted one bit for bit, with the extras."""
    root = tmp_path / "ckpt"
    a, oa = _model_and_opt()
    _train(a, oa, 2)
    fg.save_checkpoint(root, a, oa, step=2)
    _train(a, oa, 1)
    fg.save_checkpoint(root, a, oa, step=3)
    assert [p.name[:12] for p in root.iterdir() if p.is_dir()] == ["ckpt-000002-"]
    _train(a, oa, 2)
    b, ob = _model_and_opt()
    _train(b, ob, 1)  # live values that the load replaces
    model, opt, extra = fg.load_checkpoint(root, b, ob)
    assert model is b and opt is ob and extra == {"step": 3}
    _train(b, ob, 2)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert int(ob.tx_state.count) == 5


def test_a_directory_checkpoint_that_fails_to_load_changes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    a, oa = _model_and_opt()
    _train(a, oa, 2)
    fg.save_checkpoint(root, a, oa)
    sub = root / (root / "LATEST").read_text().strip()
    b, ob = _model_and_opt()
    _train(b, ob, 1)
    before = _live(b, ob)
    (sub / "funcgrad-manifest.json").write_text("{")
    with pytest.raises(ValueError) as info:
        fg.load_checkpoint(root, b, ob)
    assert "has no readable manifest (funcgrad-manifest.json)" in str(info.value)
    assert _live(b, ob)[1] == before[1]
    for k, v in before[0].items():
        assert torch.equal(_live(b, ob)[0][k], v), k


def _dir_ckpt(tmp_path):
    root = tmp_path / "ckpt"
    m, opt = _model_and_opt()
    _train(m, opt, 1)
    fg.save_checkpoint(root, m, opt)
    return root, root / (root / "LATEST").read_text().strip()


def _missing_shard(tmp_path):
    root, sub = _dir_ckpt(tmp_path)
    (sub / "__0_0.distcp").unlink()
    fg.load_checkpoint(root, *_model_and_opt())


def _other_model(tmp_path):
    root, _ = _dir_ckpt(tmp_path)
    m = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    fg.load_checkpoint(root, m, fg.Optimizer(m.double(), fg.adamw(lr=1e-2)))


def _no_pointer(tmp_path):
    (tmp_path / "empty").mkdir()
    fg.load_checkpoint(tmp_path / "empty", *_model_and_opt())


def _mismatched(tmp_path):
    m, _ = _model_and_opt()
    _, other = _model_and_opt()
    fg.save_checkpoint(tmp_path / "ckpt", m, other)


def _a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    fg.save_checkpoint(tmp_path / "f", *_model_and_opt())


def _file_for_optimizer(tmp_path):
    fg.load_checkpoint(tmp_path / "nothing.fg", *_model_and_opt())


def _wrong_kinds(tmp_path):
    m, _ = _model_and_opt()
    fg.save_checkpoint(tmp_path / "ckpt", m, fg.adam().init({"w": torch.ones(1)}))


def _bad_extra(tmp_path):
    fg.save_checkpoint(tmp_path / "ckpt", *_model_and_opt(), model=torch.nn.Linear(1, 1))


def _no_parent(tmp_path):
    fg.save_checkpoint(tmp_path / "no" / "ckpt", *_model_and_opt())


def _param_groups(tmp_path):
    _, opt = _model_and_opt()
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]
    opt.load_state_dict(sd)


DIR_ERRORS = [
    (_missing_shard, ValueError, "is missing from the checkpoint; load an earlier one."),
    (_other_model, ValueError, "fg.load_checkpoint: torch.distributed.checkpoint could not read"),
    (_no_pointer, ValueError, "holds no published checkpoint (no LATEST file)"),
    (
        _mismatched,
        ValueError,
        "fg.save_checkpoint: the fg.Optimizer was not built on this model's parameters",
    ),
    (_a_file, FileExistsError, "is a file; a distributed checkpoint is a directory"),
    (_file_for_optimizer, FileNotFoundError, "is not a distributed checkpoint directory"),
    (
        _wrong_kinds,
        TypeError,
        "fg.save_checkpoint: give a params dict and a state, or a model and its fg.Optimizer; got Sequential and AdamState.",
    ),
    (_bad_extra, TypeError, "fg.save_checkpoint: extra values must be numbers"),
    (_no_parent, FileNotFoundError, "fg.save_checkpoint: the directory"),
    (
        _param_groups,
        ValueError,
        "fg.Optimizer.load_state_dict: the state dict's param groups do not match",
    ),
]


@pytest.mark.parametrize(("trigger", "exc", "fragment"), DIR_ERRORS)
def test_directory_checkpoint_errors(tmp_path, trigger, exc, fragment):
    with pytest.raises(exc) as info:
        trigger(tmp_path)
    assert fragment in str(info.value)
