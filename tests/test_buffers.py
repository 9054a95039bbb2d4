"""Train-mode BatchNorm (and any buffer written in forward) in the functional step:
make_step(buffers=True) against eager torch training in train mode."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from references import (
    assert_matches_resnet,
    resnet_batches,
    resnet_funcgrad_run,
    resnet_model,
    resnet_reference,
)
from torch._dynamo.utils import counters

import funcgrad as fg


def test_eager_step_with_buffers_equals_eager_torch_training():
    data = resnet_batches(4)
    ref = resnet_reference(resnet_model(), data)
    model = resnet_model()
    params, buffers = resnet_funcgrad_run(model, data)
    assert_matches_resnet(params, buffers, ref)
    assert int(buffers["block.bn2.num_batches_tracked"]) == 4
    assert float(buffers["peak.peak"]) > 0
    # Not donated: the module's own buffers did not move.
    assert int(model.block.bn1.num_batches_tracked) == 0


def test_buffers_really_change_the_model_output():
    """The check above is not empty: running statistics after training differ from
    the initial ones, so eval-mode outputs differ too."""
    data = resnet_batches(4)
    model = resnet_model()
    before = copy.deepcopy(model).eval()(data[0][0])
    resnet_funcgrad_run(model, data, donate=True)
    after = model.eval()(data[0][0])
    assert not torch.allclose(before, after)


@pytest.fixture(scope="module")
def compiled_resnet_run():
    """One inductor-compiled donated run of 100 steps, shared by the tests below."""
    torch._dynamo.reset()
    counters.clear()
    data = resnet_batches(100)
    model = resnet_model()
    params, buffers = resnet_funcgrad_run(model, data, compile=True, donate=True)
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    return model, params, buffers, data, graphs, breaks


def test_compiled_donated_step_with_buffers_equals_eager_torch(compiled_resnet_run):
    model, params, buffers, data, graphs, breaks = compiled_resnet_run
    assert graphs == 1 and not breaks  # one graph for 100 steps: 0 recompiles
    ref = resnet_reference(resnet_model(), data)
    assert_matches_resnet(params, buffers, ref, tol=1e-9)
    # Donated: the module holds the trained params and running statistics ...
    for k, v in fg.buffers(model).items():
        assert v.data_ptr() == buffers[k].data_ptr(), k
    assert int(model.block.bn1.num_batches_tracked) == 100
    # ... so evaluation after training uses them, like a torch-trained model.
    x = data[0][0]
    torch.testing.assert_close(model.eval()(x), ref.eval()(x), rtol=1e-9, atol=1e-9)


def _without_buffers():
    """A train-mode ResNet, a loss that does not pass buffers, Adam, one input."""
    model = resnet_model()

    def loss_fn(p, x):
        return fg.call(model, p, x).sum()

    return loss_fn, fg.adam(), fg.params(model), resnet_batches(1)[0][0]


def test_step_without_buffers_explains_the_fix_eager_and_compiled():
    loss_fn, tx, params, x = _without_buffers()
    for compile in (
        False,
        {"backend": "aot_eager"},
        {"scope": "gradients", "backend": "aot_eager"},
    ):
        torch._dynamo.reset()
        step = fg.make_step(loss_fn, tx, compile=compile)
        with pytest.raises(
            RuntimeError, match=re.escape("build it with fg.make_step(..., buffers=True)")
        ):
            step(params, tx.init(params), x)


def test_per_sample_gradients_with_train_mode_batchnorm_are_refused():
    """One message, saying what works: not the buffers=True advice, which per_sample=
    refuses (it was in the message's "Original error" part)."""
    loss_fn, tx, params, x = _without_buffers()
    step = fg.make_step(loss_fn, tx, per_sample=fg.clip_by_global_norm(1.0))
    with pytest.raises(
        RuntimeError, match=re.escape("BatchNorm in train mode: batch statistics mix the samples")
    ) as err:
        step(params, tx.init(params), x)
    assert "buffers=True" not in str(err.value)


def test_buffers_step_errors():
    model = resnet_model()
    tx = fg.adam()

    def loss_fn(p, b, x):
        return fg.call(model, p, x, buffers=b).sum()

    params = fg.params(model)
    x = resnet_batches(1)[0][0]
    step = fg.make_step(loss_fn, tx, buffers=True)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "fg.make_step(buffers=True): the step is called as step(params, state, buffers, *batch)"
        ),
    ):
        step(params, tx.init(params), x)
    bad = dict(fg.buffers(model))
    bad["block.bn9.running_mean"] = bad.pop("block.bn1.running_mean")
    with pytest.raises(
        KeyError,
        match=re.escape(
            "fg.call: 'block.bn9.running_mean' is not a buffer of TinyResNet (did you mean 'block.bn2.running_mean'?)"
        ),
    ):
        step(params, tx.init(params), bad, x)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "loss_fn(p, b, x) cannot be called with params, buffers and 2 batch argument(s)"
        ),
    ):
        step(params, tx.init(params), fg.buffers(model), x, x)


def test_the_step_watch_follows_the_context_not_the_process():
    """``fg.call`` refuses a buffer write only inside a step's forward: in this context
    and the asyncio tasks it starts, never in another thread (the flag is a
    ``ContextVar``, funcgrad/model/_model.py)."""
    import asyncio
    import threading

    from funcgrad.model._model import watching_buffers

    bn = torch.nn.BatchNorm1d(3).train()
    params = dict(fg.params(bn))
    x = torch.randn(4, 3)
    seen: list[str] = []

    def plain_call() -> None:
        try:
            fg.call(bn, params, x)
            seen.append("ran")
        except RuntimeError as err:
            seen.append("refused" if "buffers=True" in str(err) else repr(err))

    async def in_a_task() -> None:
        plain_call()

    with watching_buffers():
        plain_call()  # this context: refused
        t = threading.Thread(target=plain_call)
        t.start()
        t.join()  # a new thread: a plain call
        asyncio.run(in_a_task())  # a task copies this context: refused
    plain_call()  # after the step: a plain call
    assert seen == ["refused", "ran", "refused", "ran"]
