"""The time budget's last guard on training (`trainer.plan.policy.PlanRecord.deadline`): the step that
ends past the deadline is the run's last, validated and saved as a planned last step is. The
budget plans single-process runs only: ranks would read their clocks apart."""

from __future__ import annotations

import time


def deadline_stop(deadline: float | None, step: int, total: int) -> str | None:
    """The line to print when step `step`, short of the planned `total`, ended past `deadline`
    (a `time.perf_counter()` value; None: no deadline), which makes it the last; else None."""
    if deadline is None or step >= total or time.perf_counter() <= deadline:
        return None
    return f"step {step}: the time the budget left for training is spent; stopping before step {total}"
