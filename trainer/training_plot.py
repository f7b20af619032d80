"""training.png beside summary.json: the training loss and the validation acceptance against step,
drawn from history.json, for the person who would rather look than read JSON.

Validation acceptance is the simulated chain acceptance length (teacher-forced: every draft step
reads the true prefix) and, where decoded validation ran (`optim.val_decode_prompts`, on by
default), the decoded one, side by side: the gap between them is what serving loses to drafts
that read their own earlier guesses, and the curves say whether more steps or more data would
have helped, and which one the kept head was chosen by.
"""

from __future__ import annotations

from pathlib import Path

from conf.files import atomic_write
from trainer.collapse import SIM
from trainer.selection import DECODED

ACCEPTANCE = {SIM: "simulated (teacher-forced)", DECODED: "decoded"}


def acceptance_curves(history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The validation acceptance curves the right panel draws, by label: (step, τ) where that
    validation measured it."""
    val = [(h["step"], h["val"]) for h in history if "val" in h]
    curves = {label: [(s, m[key]) for s, m in val if m.get(key) is not None]
              for key, label in ACCEPTANCE.items()}
    return {label: points for label, points in curves.items() if points}


def plot_training(history: list[dict], path: Path) -> Path:
    """Two panels against step: train and validation loss; validation acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    val = [(h["step"], h["val"]) for h in history if "val" in h]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        loss_ax.plot(*zip(*train), label="train")
    if val:
        loss_ax.plot([s for s, _ in val], [m.get("loss") for _, m in val], marker="o", label="validation")
    loss_ax.set(xlabel="step", ylabel="loss", title="Loss")
    loss_ax.legend()
    for label, points in acceptance_curves(history).items():
        acc_ax.plot(*zip(*points), marker="o", label=label)
    acc_ax.set(xlabel="step", ylabel="acceptance length (τ)", title="Validation acceptance")
    if acc_ax.lines:
        acc_ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path
