"""A run can fail while every value stays finite: at `optim.lr=1e6` the head stops predicting
anything the target would accept. `collapse` names the validation where the simulated acceptance
length fell to 1.0 after having been above it, `never_rose` a run where it never left 1.0, and
`CollapseWatch` keeps the first such record of a run (summary.json's `acceptance_collapse`).
"""

from __future__ import annotations

from conf.schema import OptimConfig

SIM = "sim_acceptance_length"  # the validation metric both head kinds report
COLLAPSED = 1.0005  # below it a simulated acceptance length shows as 1.000: nothing accepted


def _validations(history: list[dict]) -> list[tuple[float, int]]:
    """(simulated acceptance length, step) of each validation in `history`."""
    return [(h["val"][SIM], h["step"]) for h in history if SIM in h.get("val", {})]


def collapse(history: list[dict], metrics: dict[str, float], step: int) -> dict | None:
    """{step, sim_acceptance_length, peak, peak_step} when this validation's simulated acceptance
    length fell to 1.0 after an earlier one (in `history`) was above it, else None: the head no
    longer drafts anything the target accepts, yet every value may be finite."""
    value, earlier = metrics.get(SIM), _validations(history)
    if value is None or value >= COLLAPSED or not earlier or max(earlier)[0] < COLLAPSED:
        return None
    peak, peak_step = max(earlier)
    return {"step": step, SIM: value, "peak": peak, "peak_step": peak_step}


def never_rose(history: list[dict]) -> dict | None:
    """The same record when no validation of the run ever rose above 1.0 (a run diverged from
    its first steps, as at `optim.lr=1e6`, or that learned nothing), else None."""
    seen = _validations(history)
    if not seen or max(seen)[0] >= COLLAPSED:
        return None
    peak, peak_step = max(seen)
    return {"step": seen[-1][1], SIM: seen[-1][0], "peak": peak, "peak_step": peak_step}


def collapse_line(c: dict, optim: OptimConfig, best_step: int) -> str:
    """The log line for a `collapse` or `never_rose` record."""
    fix = f"try a lower optim.lr, now {optim.lr:g}"
    if c["peak"] < COLLAPSED:
        return (
            f"step {c['step']}: no validation's simulated acceptance length rose above "
            f"{c['peak']:.3f}: the kept head (step {best_step}) drafts nothing the target accepts "
            f"({fix})"
        )
    return (
        f"step {c['step']}: simulated acceptance length fell to {c[SIM]:.3f} (it was "
        f"{c['peak']:.3f} at step {c['peak_step']}): the head no longer drafts tokens the target "
        f"accepts, the run diverged ({fix}); the kept head is the best so far, from step {best_step}"
    )


class CollapseWatch:
    """The run's first collapse, or at its end a run that never rose (`record`, None: neither),
    each with the line the run prints for it."""

    def __init__(self, optim: OptimConfig):
        self.optim = optim
        self.record: dict | None = None

    def validated(
        self, history: list[dict], metrics: dict[str, float], step: int, best_step: int
    ) -> str | None:
        """The line to print when this validation (not yet in `history`) is a collapse."""
        return self._noted(collapse(history, metrics, step), best_step)

    def ended(self, history: list[dict], best_step: int) -> str | None:
        """The line to print when the run, which did not collapse, never rose above 1.0."""
        return None if self.record is not None else self._noted(never_rose(history), best_step)

    def _noted(self, fell: dict | None, best_step: int) -> str | None:
        if fell is None:
            return None
        fell["message"] = collapse_line(fell, self.optim, best_step)
        self.record = self.record or fell
        return fell["message"]
