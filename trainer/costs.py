"""Where a fit's time goes: the steps, the waits for data, and the work between steps.

The time budget (`trainer.plan`) models a run as steps at the steps' own rate plus validations,
best-head saves and checkpoints at the cadence of `optim.val_every` and `optim.save_every`, so
the loop times that work apart from the steps, per kind and per occurrence. The kinds are fields
of `BetweenSteps`: a misspelt kind fails where it is timed instead of counting into a new key
the planner would never read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

# The work between steps: kind -> (its seconds field, its count field) in `BetweenSteps`.
WORK = {
    "validate": ("validate_s", "validations"),
    "val_decode": ("val_decode_s", "decoded_validations"),
    "save_best": ("save_best_s", "best_saves"),
    "checkpoint": ("checkpoint_s", "checkpoints"),
}


@dataclass(frozen=True)
class BetweenSteps:
    """Seconds and counts of the work a fit did between its steps."""

    # validation metrics over the validation split
    validate_s: float = 0.0
    validations: int = 0
    # decoded validation (`trainer.val_decode`): priced apart, since it grows with the prompts
    # decoded, not with the split
    val_decode_s: float = 0.0
    decoded_validations: int = 0
    # saving run_dir/head when a validation beats the kept head (collective under ZeRO-3)
    save_best_s: float = 0.0
    best_saves: int = 0
    # a checkpoint and history.json
    checkpoint_s: float = 0.0
    checkpoints: int = 0

    @property
    def seconds(self) -> float:
        return self.validate_s + self.val_decode_s + self.save_best_s + self.checkpoint_s

    def per_validation(self) -> float:
        """Seconds one validation took (0.0: none ran)."""
        return self.validate_s / max(self.validations, 1)

    def per_decoded_validation(self) -> float:
        """Seconds one decoded validation took (0.0: none ran)."""
        return self.val_decode_s / max(self.decoded_validations, 1)

    def per_best_save(self) -> float:
        return self.save_best_s / max(self.best_saves, 1)

    def per_checkpoint(self) -> float:
        return self.checkpoint_s / max(self.checkpoints, 1)

    def summary(self) -> dict[str, float | int]:
        return asdict(self)


class BetweenStepsClock:
    """Accumulates `BetweenSteps`: `with clock.timed("validate"): ...`."""

    def __init__(self) -> None:
        self.spent = BetweenSteps()

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        if kind not in WORK:
            raise ValueError(f"no work between steps is called {kind!r} (one of {', '.join(WORK)})")
        seconds, count = WORK[kind]
        began = time.perf_counter()
        yield
        took = time.perf_counter() - began
        was = self.spent
        self.spent = replace(was, **{seconds: getattr(was, seconds) + took, count: getattr(was, count) + 1})


@dataclass
class Throughput:
    """Real (unpadded) tokens trained and seconds spent waiting for batches since `began`: the
    share of training time a slow data path costs (on a GPU host it can exceed the step itself)."""

    tokens: int = 0
    waited: float = 0.0
    began: float = field(default_factory=time.perf_counter)
    first_step: tuple[float, int] | None = None  # (seconds since `began`, tokens) as the first step ended

    def waiting(self, batches: Iterable) -> Iterator:
        """Yield from `batches`, adding the seconds spent waiting for each to `waited`."""
        it = iter(batches)
        while True:
            start = time.perf_counter()
            batch = next(it, None)
            self.waited += time.perf_counter() - start
            if batch is None:
                return
            yield batch

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.began, 1e-9)

    def tokens_per_s(self, apart_s: float = 0.0) -> float:
        """Since `began`, less `apart_s` seconds (the work between steps, for the steps' own rate)."""
        return self.tokens / max(self.elapsed() - apart_s, 1e-9)

    def step_ended(self) -> None:
        """Mark the end of the first step (later calls change nothing)."""
        if self.first_step is None:
            self.first_step = (self.elapsed(), self.tokens)

    def steady_tokens_per_s(self, apart_s: float = 0.0) -> float:
        """The steps' own rate after the first, less `apart_s` seconds of work between steps (all
        of it after the first step). The first step starts the loader and touches every weight
        and optimizer buffer once, which a run pays once: read over the training probe's six
        steps with it, the rate charged a sixth of it to every step of the run (on SmolLM2 10%
        too slow, and the main job ended minutes early). A fit of one step has only its rate."""
        if self.first_step is None or self.first_step[1] == self.tokens:
            return self.tokens_per_s(apart_s)
        seconds, tokens = self.first_step
        return (self.tokens - tokens) / max(self.elapsed() - seconds - apart_s, 1e-9)

    def wait_fraction(self) -> float:
        return self.waited / self.elapsed()
