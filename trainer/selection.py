"""Which head a run keeps: the best by `optim.select_by` over its validations, in run_dir/head.

The choice lives in the run's `TrainState` (best score and step), so a resumed run goes on
comparing against the head it kept before. Every rank must take the same branch (saving is
collective under ZeRO-3): the choice reads only reduced metrics, never the file system.
"""

from __future__ import annotations

import math
from pathlib import Path

from conf.files import disk_full_is_one_line
from trainer.checkpoint import RESUME_THEN, TrainState
from trainer.collapse import SIM

DECODED = "decoded_acceptance_length"  # the validation metric decoded validation adds
DECODED_SE = "decoded_acceptance_length_se"  # and its standard error (`val_decode.acceptance_se`)


def kept_head_dir(run_dir: Path) -> Path:
    return run_dir / "head"


def chosen_by(select_by: str, decodes: bool) -> str:
    """What `optim.select_by` (conf.schema.SELECT_BY) chooses by in a run that decodes in
    validation (`decodes`) or not: auto is decoded where decoded validation runs."""
    if select_by == "auto":
        return "decoded" if decodes else "simulated"
    return select_by


def selection_score(metrics: dict[str, float], select_by: str) -> float | None:
    """The validation number the kept head is chosen by (higher is better; `chosen_by`'s
    answer): the trainee's simulated `score` or the decoded acceptance length. None: no
    validation data."""
    return metrics.get("score" if select_by == "simulated" else DECODED)


def selection_margin(metrics: dict[str, float], select_by: str) -> float:
    """How far below the kept head's score a later head may validate and still be kept: one
    standard error of the difference of two decoded figures (sqrt(2) x this one's), 0 for the
    simulated score (teacher-forced over the whole split, it barely wobbles). A few short prompts
    decode a noisy figure, and the largest of several noisy figures is an early head's by
    chance: on the README's main job (2026-12-07) select-by-highest kept step 100 (decoded 1.365)
    over step 217 (1.356, within 0.075), which evaluated at τ 1.244 against step 217's 1.310."""
    if select_by == "simulated":
        return 0.0
    return math.sqrt(2) * metrics.get(DECODED_SE, 0.0)


def kept_validation(history: list[dict], best_step: int) -> dict | None:
    """The kept head's validation figures, for the gap the closing lines and eval.md report:
    its step, the simulated (teacher-forced) and decoded acceptance lengths (None where not
    measured). None: no validation kept a head."""
    val = next((h["val"] for h in history if h["step"] == best_step and "val" in h), None)
    if val is None:
        return None
    return {"step": best_step, "simulated": val.get(SIM), "decoded": val.get(DECODED)}


def keeps(state: TrainState, score: float | None, margin: float = 0.0) -> bool:
    """Whether the head validated at `state.step` with `score` is kept: it beats the best score
    so far (`state.best_score`, which it then becomes), or comes closer than `margin` to it (a later
    head that trained longer wins a tie within noise; the bar stays the best, so a slow decline
    is never followed). No validation data (None): the latest is kept."""
    if score is None or score > state.best_score:
        state.best_score = float("-inf") if score is None else score
    elif score <= state.best_score - margin:
        return False
    state.best_step = state.step
    return True


def save_best(accelerator, trainee, out_dir: Path) -> None:
    """Collective (ZeRO-3 gathers the partitioned weights on every rank); rank 0 writes."""
    state = accelerator.get_state_dict(trainee)
    if accelerator.is_main_process:
        with disk_full_is_one_line(out_dir.parent, RESUME_THEN):
            accelerator.unwrap_model(trainee).save_pretrained(out_dir, state=state)
    accelerator.wait_for_everyone()
