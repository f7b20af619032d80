"""The time budget's last guard on training (`trainer.plan.policy.PlanRecord.deadline`): the step that
ends past the deadline is the run's last, validated and saved as a planned last step is. Ranks
read their clocks apart, and a rank that stopped alone would leave the others waiting in the next
step's collectives: under torchrun rank 0's clock decides for all (`trainer.saving.rank0_share`)."""

from __future__ import annotations

import time

from trainer.saving import Share, rank0_decides


def deadline_stop(deadline: float | None, step: int, total: int, share: Share | None = None,
                  every: int = 1) -> str | None:
    """The line to print when step `step`, short of the planned `total`, ended past `deadline`
    (a `time.perf_counter()` value; None: no deadline), which makes it the last; else None.
    `share`: several ranks take rank 0's verdict, read at every `every`-th step only, where the
    loop reads the device anyway (logging), as checkpoints by time do (`trainer.saving`); None:
    one process reads its own clock after every step."""
    if deadline is None or step >= total:
        return None
    if share is None:
        past = time.perf_counter() > deadline
    else:
        past = rank0_decides(step, every, share, lambda: time.perf_counter() > deadline)
    if not past:
        return None
    return f"step {step}: the time the budget left for training is spent; stopping before step {total}"
