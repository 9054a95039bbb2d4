"""The seed question, answered with funcgrad, beside the published hook answer.

The question: for each layer of a network, if all of the layer's gradients are
exactly zero set them to 1.0, otherwise set the zero entries to 0.5.

The published answer registers ``Tensor.register_hook`` on every parameter and, inside
the hook, reads ``param.grad`` of the layer's parameters to make the layer-level
decision. Tensor hooks fire *before* ``.grad`` is written, so that read sees ``None``
(after ``zero_grad()``, which sets grads to None by default), zeros, or a half-written
layer. This script re-implements that behaviour and shows, per step and layer, where
the gradients it hands to Adam differ from the intended rule, computed from the same
parameters at the same step.

Run: ``python examples/seed_rule.py`` (add ``--help`` for options).
"""

from __future__ import annotations

import argparse

from _cli import ShowDefaults, summary


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(formatter_class=ShowDefaults, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps shown in detail (seed 0)")
    ap.add_argument("--seeds", type=int, default=20, help="seeds in the summary")
    ap.add_argument("--summary-steps", type=int, default=100, help="steps per seed in the summary")
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
from hook_answer import attach_hook_answer  # the published answer, re-implemented
from torch import nn

import funcgrad as fg


class Model(nn.Module):
    """The model of the question: Linear(1,2) -> ReLU -> Linear(2,3) -> ReLU -> Linear(3,1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 2)
        self.fc2 = nn.Linear(2, 3)
        self.fc3 = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def seed_loss(out: torch.Tensor) -> torch.Tensor:
    return torch.mean(torch.square(torch.tensor(5.0) - torch.sum(out)))


def compare(seed: int, steps: int, verbose: bool) -> tuple[int, int, float, float]:
    """Train with the hook answer; at every step compare its grads with the intended
    rule on the same params. Also train the funcgrad version from the same init.

    Returns (steps where the hook differs, layer-steps where it differs, final loss
    with hooks, final loss with funcgrad).
    """
    torch.manual_seed(seed)
    hooked = Model()
    clean = Model()
    clean.load_state_dict(hooked.state_dict())
    features = torch.rand((3, 1))
    groups = fg.group_by_module(clean, types=nn.Linear)
    rule = fg.per_group(fg.rules.zero_fix(), groups)

    # The hook answer, with torch.optim.Adam and the default zero_grad().
    attach_hook_answer(hooked)
    opt = torch.optim.Adam(hooked.parameters())

    # funcgrad: grads -> per-layer rule -> Adam, one pure step.
    tx = fg.chain(rule, fg.adam())
    params = fg.params(clean)
    state = tx.init(params)
    step = fg.make_step(lambda p, x: seed_loss(fg.call(clean, p, x)), tx, donate=True)

    def intended(model: nn.Module) -> dict[str, torch.Tensor]:
        p = fg.params(model)
        raw = torch.func.grad(lambda q: seed_loss(fg.call(model, q, features)))(p)
        return rule.update(raw, rule.init(p))[0]

    bad_steps = bad_layer_steps = 0
    for i in range(steps):
        want = intended(hooked)  # from the hooked model's current params
        opt.zero_grad()
        loss = seed_loss(hooked(features))
        loss.backward()
        got = {n: p.grad for n, p in hooked.named_parameters()}
        wrong = [
            g for g, names in groups.items() if any(not torch.equal(got[n], want[n]) for n in names)
        ]
        bad_steps += bool(wrong)
        bad_layer_steps += len(wrong)
        if verbose:
            print(
                f"step {i:3d}  loss {loss.item():8.4f}  hook differs from the rule in: "
                f"{', '.join(wrong) if wrong else '-'}"
            )
            for g in wrong:
                for n in (n for n in groups[g] if not torch.equal(got[n], want[n])):
                    print(f"      {n:11s} hook {got[n].flatten().tolist()}")
                    print(f"      {'':11s} rule {want[n].flatten().tolist()}")
        opt.step()
        params, state, _ = step(params, state, features)
    final_hook = seed_loss(hooked(features)).item()
    final_fg = seed_loss(clean(features)).item()
    return bad_steps, bad_layer_steps, final_hook, final_fg


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = parser()
    args = ap.parse_args(argv)
    for name in ("steps", "seeds", "summary_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    print(f"Seed 0, {args.steps} steps: where the hook answer's gradients differ from the rule\n")
    compare(0, args.steps, verbose=True)

    total_bad = total_layer = 0
    loss_hook = loss_fg = 0.0
    for seed in range(args.seeds):
        bad, bad_layers, lh, lf = compare(seed, args.summary_steps, verbose=False)
        total_bad += bad
        total_layer += bad_layers
        loss_hook += lh / args.seeds
        loss_fg += lf / args.seeds
    n = args.seeds * args.summary_steps
    print(
        f"\nSummary over {args.seeds} seeds x {args.summary_steps} steps: the hook answer's "
        f"gradients differ from the intended rule in {total_bad} of {n} steps "
        f"({total_layer} of {3 * n} layer-steps).\n"
        f"Mean final loss: hook answer {loss_hook:.4f}, funcgrad (intended rule) {loss_fg:.4f}."
    )
    summary(
        "seed_rule",
        seeds=args.seeds,
        bad_steps=f"{total_bad}/{n}",
        bad_layer_steps=f"{total_layer}/{3 * n}",
        loss_hook=loss_hook,
        loss_funcgrad=loss_fg,
    )
    return {
        "bad_steps": total_bad,
        "steps": n,
        "bad_layer_steps": total_layer,
        "loss_hook": loss_hook,
        "loss_funcgrad": loss_fg,
    }


if __name__ == "__main__":
    main()
