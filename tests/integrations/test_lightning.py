"""fg.Optimizer inside PyTorch Lightning (#23): ``configure_optimizers`` returns it with a
torch scheduler; the trained parameters and the monitor's statistics equal the same steps
run by hand with fg.Optimizer. Run by ``make test-integrations`` (``funcgrad[integrations]``)."""

from __future__ import annotations

import lightning as L
import torch
from integration_refs import STEPS, batches, by_hand, dead_model, named_seed_tx, seed_objective

import funcgrad as fg


class SeedLit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = dead_model()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return seed_objective(self.net, batch)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = fg.Optimizer(self.net, named_seed_tx(self.net))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_lightning_fit_equals_the_same_steps_by_hand():
    lit = SeedLit()
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, train_dataloaders=batches())
    opt = trainer.optimizers[0]
    assert isinstance(opt, fg.Optimizer)
    assert int(opt.tx_state["adam"].count) == STEPS

    want_net, want_opt = by_hand()
    for (n, p), (_, q) in zip(lit.net.named_parameters(), want_net.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=n)
    got, want = opt.tx_state["monitor"].stats, want_opt.tx_state["monitor"].stats
    assert bool(got["fc1"]["all_zero"]) and not bool(got["fc2"]["all_zero"])  # both branches
    for g in want:
        for k in want[g]:
            torch.testing.assert_close(got[g][k], want[g][k], rtol=0, atol=0)
    # the scheduler drove the learning rate through the param group
    assert opt.param_groups[0]["lr"] == want_opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] < 1e-2
