"""Which head a run keeps: the best by `optim.select_by` over its validations, in run_dir/head.

The choice lives in the run's `TrainState` (best score and step), so a resumed run goes on
comparing against the head it kept before. Every rank must take the same branch (saving is
collective under ZeRO-3): the choice reads only reduced metrics, never the file system.
"""

from __future__ import annotations

from pathlib import Path

from conf.files import disk_full_is_one_line
from trainer.checkpoint import RESUME_THEN, TrainState

DECODED = "decoded_acceptance_length"  # the validation metric decoded validation adds


def kept_head_dir(run_dir: Path) -> Path:
    return run_dir / "head"


def selection_score(metrics: dict[str, float], select_by: str) -> float | None:
    """The validation number the kept head is chosen by (higher is better; conf.schema.SELECT_BY):
    the trainee's simulated `score` or the decoded acceptance length. None: no validation data."""
    return metrics.get("score" if select_by == "simulated" else DECODED)


def keeps(state: TrainState, score: float | None) -> bool:
    """Whether the head validated at `state.step` with `score` beats the kept one; if so it
    becomes the kept one in `state`. No validation data (None): the latest is kept."""
    if score is None or score > state.best_score:
        state.best_score = float("-inf") if score is None else score
        state.best_step = state.step
        return True
    return False


def save_best(accelerator, trainee, out_dir: Path) -> None:
    """Collective (ZeRO-3 gathers the partitioned weights on every rank); rank 0 writes."""
    state = accelerator.get_state_dict(trainee)
    if accelerator.is_main_process:
        with disk_full_is_one_line(out_dir.parent, RESUME_THEN):
            accelerator.unwrap_model(trainee).save_pretrained(out_dir, state=state)
    accelerator.wait_for_everyone()
