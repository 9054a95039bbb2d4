"""fg.Optimizer inside Hugging Face ``transformers.Trainer`` (#23):
``Trainer(optimizers=(fg.Optimizer(...), scheduler))``; the trained parameters and the
monitor's statistics equal the same steps run by hand with fg.Optimizer. Run by
``make test-integrations`` (``funcgrad[integrations]``)."""

from __future__ import annotations

import torch
from integration_refs import STEPS, batch, by_hand, dead_model, named_seed_tx, seed_objective
from torch import nn
from transformers import Trainer, TrainingArguments

import funcgrad as fg


class SeedNet(nn.Module):
    """What Trainer expects of a model: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = dead_model()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": seed_objective(self.net, x)}


class Steps(torch.utils.data.Dataset):
    """One item per step: the step's whole batch (Trainer adds a leading dim of 1)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": batch(i)}


def _args(tmp_path, **kwargs) -> TrainingArguments:
    """STEPS steps of one item on the CPU, nothing saved, logged or reported."""
    return TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs,
    )


def _train(trainer: Trainer) -> None:
    # in order, as the hand loop: Trainer shuffles by default
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Steps())
    trainer.train()


def test_hf_trainer_equals_the_same_steps_by_hand(tmp_path):
    model = SeedNet()
    opt = fg.Optimizer(model.net, named_seed_tx(model.net))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    args = _args(tmp_path, max_grad_norm=0.0)  # Trainer clips at 1.0; the hand loop does not
    _train(Trainer(model=model, args=args, train_dataset=Steps(), optimizers=(opt, sched)))
    assert int(opt.tx_state["adam"].count) == STEPS

    want_net, want_opt = by_hand()
    for (n, p), (_, q) in zip(
        model.net.named_parameters(), want_net.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=n)
    got, want = opt.tx_state["monitor"].stats, want_opt.tx_state["monitor"].stats
    assert bool(got["fc1"]["all_zero"]) and not bool(got["fc2"]["all_zero"])  # both branches
    for g in want:
        for k in want[g]:
            torch.testing.assert_close(got[g][k], want[g][k], rtol=0, atol=0)
    assert opt.param_groups[0]["lr"] == want_opt.param_groups[0]["lr"] < 1e-2


def _trainer_run(tmp_path, optimizer_cls_and_kwargs):
    model = SeedNet()
    # weight_decay: Trainer's decay group; biases go to its weight_decay=0.0 group
    args = _args(tmp_path, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Steps(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
    )
    _train(trainer)
    return model, trainer.optimizer


def test_hf_trainer_builds_fg_optimizer_from_its_own_param_groups(tmp_path):
    """``optimizer_cls_and_kwargs=(fg.Optimizer, {"tx": fg.adamw(...)})``: Trainer builds
    its decay/no-decay param groups, its linear warmup schedule and its gradient
    clipping around fg.Optimizer, as around torch.optim.AdamW; the trained parameters
    equal AdamW's."""
    got, opt = _trainer_run(tmp_path / "fg", (fg.Optimizer, {"tx": fg.adamw(lr=1e-2)}))
    want, ref = _trainer_run(tmp_path / "torch", (torch.optim.AdamW, {"lr": 1e-2}))
    assert isinstance(opt.optimizer if hasattr(opt, "optimizer") else opt, fg.Optimizer)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14, msg=n)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    start = SeedNet()
    assert not torch.equal(got.net.fc3.weight, start.net.fc3.weight)  # it trained
