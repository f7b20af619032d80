"""training.png: the loss, and the validation acceptance simulated (teacher-forced) and decoded,
side by side wherever decoded validation measured it."""

from __future__ import annotations

from trainer.selection import DECODED
from trainer.training_plot import acceptance_curves, plot_training


def test_both_acceptance_curves_are_drawn_where_measured(tmp_path):
    history = [
        {"step": 10, "loss": 4.0},
        {"step": 10, "val": {"loss": 3.9, "sim_acceptance_length": 1.6, DECODED: 1.3}},
        {"step": 20, "loss": 3.0},
        {"step": 20, "val": {"loss": 3.1, "sim_acceptance_length": 1.8, DECODED: 1.4}},
    ]
    assert acceptance_curves(history) == {
        "simulated (teacher-forced)": [(10, 1.6), (20, 1.8)],
        "decoded": [(10, 1.3), (20, 1.4)],
    }
    undecoded = [{"step": 10, "val": {"sim_acceptance_length": 1.6}}]
    assert list(acceptance_curves(undecoded)) == ["simulated (teacher-forced)"]
    path = plot_training(history, tmp_path / "training.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
