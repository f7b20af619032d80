"""The parts `trainer.loop.fit` calls between its steps, each on its own: the non-finite guard,
the deadline, the timing of the work between steps, collapse detection, the kept-head choice
and the report. In process, on plain tensors: fit runs them end to end in test_val_decode.py."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from conf.errors import UserError
from conf.schema import OptimConfig
from trainer.checkpoint import TrainState
from trainer.collapse import SIM, CollapseWatch
from trainer.costs import BetweenSteps, BetweenStepsClock, Throughput
from trainer.deadline import deadline_stop
from trainer.health import NonFiniteGuard
from trainer.loop import FitReport
from trainer.selection import DECODED, DECODED_SE, keeps, selection_margin

NAN = float("nan")


class Rows:
    """The loop's dataset interface: four finite samples of four tokens."""

    lengths = [4, 4, 4, 4]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(4), "aux_hidden": torch.zeros(4, 2)}


def guarded(tmp_path: Path, **optim) -> tuple[NonFiniteGuard, TrainState]:
    state = TrainState()
    return NonFiniteGuard(Accelerator(cpu=True), state, Rows(), OptimConfig(**optim), 0, tmp_path), state


def step(guard: NonFiniteGuard, state: TrainState, loss: float, grad_norm: float) -> None:
    """One single-micro-batch step as the loop records it."""
    guard.watch.places.append((state.step + 1, state.epoch, state.batch_in_epoch))
    guard.watch.observe(torch.tensor(loss), torch.tensor(grad_norm), None, end_of_step=True)
    state.step += 1


def test_the_guard_stops_at_the_first_non_finite_step_in_one_line(tmp_path):
    guard, state = guarded(tmp_path)
    step(guard, state, 1.0, 1.0)
    guard.check()  # clean
    step(guard, state, NAN, 1.0)
    step(guard, state, 1.0, 1.0)
    with pytest.raises(UserError) as stopped:
        guard.check()
    assert str(stopped.value) == (
        "step 2: non-finite training loss; the run stopped: no head kept yet, no checkpoint was "
        "written yet; to fix: a lower optim.lr (now 0.001) or optim.grad_clip (now 0.5), or "
        "optim.skip_nonfinite=n to skip up to n such steps"
    )


def test_the_guard_counts_skips_then_stops_past_the_budget(tmp_path):
    guard, state = guarded(tmp_path, skip_nonfinite=1)
    state.best_step = 1
    step(guard, state, 1.0, NAN)
    assert guard.skip_line().startswith(
        "step 1: non-finite gradient norm: optimizer step skipped (1 of optim.skip_nonfinite=1)"
    )
    assert guard.skip_line() is None  # taken once
    step(guard, state, 1.0, NAN)
    with pytest.raises(UserError, match=r"^step 2: non-finite gradient norm, after 1 skipped step\(s\); "
                                        r"the run stopped: the best head so far \(step 1\) stays in"):
        guard.skip_line()


def test_the_guard_stops_on_a_non_finite_validation_loss(tmp_path):
    guard, state = guarded(tmp_path)
    state.step = 4
    guard.check_validation({"loss": 2.0}, Rows())
    with pytest.raises(UserError, match="^step 4: non-finite validation loss; the run stopped"):
        guard.check_validation({"loss": NAN}, Rows())


def test_a_deadline_ends_the_step_that_passes_it_short_of_the_total():
    past = time.perf_counter()
    assert deadline_stop(past, 3, 10) == (
        "step 3: the time the budget left for training is spent; stopping before step 10"
    )
    assert deadline_stop(past, 10, 10) is None  # the planned last step anyway
    assert deadline_stop(None, 3, 10) is None
    assert deadline_stop(time.perf_counter() + 3600, 3, 10) is None


def test_ranks_stop_at_the_deadline_on_rank_0s_clock_at_logging_steps():
    """Under torchrun each rank passes its clock's verdict to `share`, which hands every rank
    rank 0's: here rank 0 is past its deadline and rank 1 is not, and both stop, at the first
    logging step (every 5), where the ranks share; between those steps nothing is shared."""
    past, ahead = time.perf_counter(), time.perf_counter() + 3600
    shared: list[bool] = []

    def rank0(verdict: bool) -> bool:  # rank 0's own verdict
        shared.append(verdict)
        return verdict

    assert deadline_stop(past, 3, 10, rank0, every=5) is None and shared == []
    line = "step 5: the time the budget left for training is spent; stopping before step 10"
    assert deadline_stop(past, 5, 10, rank0, every=5) == line and shared == [True]
    assert deadline_stop(ahead, 5, 10, lambda _: shared[0], every=5) == line  # rank 1 takes rank 0's


def test_work_between_steps_is_timed_per_kind_and_a_misspelt_kind_fails():
    clock = BetweenStepsClock()
    for _ in range(2):
        with clock.timed("validate"):
            time.sleep(0.01)
    with clock.timed("checkpoint"):
        pass
    spent = clock.spent
    assert (spent.validations, spent.best_saves, spent.checkpoints) == (2, 0, 1)
    assert spent.validate_s >= 0.02 and spent.per_validation() == spent.validate_s / 2
    assert spent.per_best_save() == 0.0 and spent.seconds == spent.validate_s + spent.checkpoint_s
    ran = []
    with pytest.raises(ValueError, match="'validation'"), clock.timed("validation"):
        ran.append(True)
    assert not ran and clock.spent == spent


def test_throughput_counts_the_waits_for_batches():
    def slow():
        for i in range(2):
            time.sleep(0.01)
            yield i

    pace = Throughput(tokens=1000)
    assert list(pace.waiting(slow())) == [0, 1]
    assert pace.waited >= 0.02 and 0 < pace.wait_fraction() <= 1
    assert pace.tokens_per_s(apart_s=0.01) > pace.tokens_per_s()


def test_the_steps_rate_leaves_the_first_steps_warm_up_out():
    pace = Throughput()
    pace.tokens = 100
    time.sleep(0.2)  # a slow first step
    pace.step_ended()
    assert pace.steady_tokens_per_s() == pytest.approx(pace.tokens_per_s(), rel=0.05)  # one step: its own
    pace.tokens += 100
    time.sleep(0.01)
    pace.step_ended()  # only the first is marked
    assert pace.first_step[1] == 100
    assert pace.steady_tokens_per_s() > 2 * pace.tokens_per_s()
    assert pace.steady_tokens_per_s(apart_s=0.005) > pace.steady_tokens_per_s()


def test_collapse_is_named_once_and_a_run_that_never_rose_at_its_end():
    watch = CollapseWatch(OptimConfig(lr=1e6))
    history = [{"step": 2, "val": {SIM: 1.3}}]
    assert watch.validated(history, {SIM: 1.2}, 4, 2) is None
    line = watch.validated(history, {SIM: 1.0}, 4, 2)
    assert line == (
        "step 4: simulated acceptance length fell to 1.000 (it was 1.300 at step 2): the head no "
        "longer drafts tokens the target accepts, the run diverged (try a lower optim.lr, now "
        "1e+06); the kept head is the best so far, from step 2"
    )
    assert watch.validated(history, {SIM: 1.0}, 6, 2) is not None  # printed again, not recorded
    assert watch.record["step"] == 4 and watch.record["message"] == line
    assert watch.ended(history, 2) is None

    flat = CollapseWatch(OptimConfig())
    assert flat.ended([{"step": 2, "val": {SIM: 1.0}}], 2).startswith(
        "step 2: no validation's simulated acceptance length rose above 1.000"
    )
    assert flat.record["peak"] == 1.0
    assert CollapseWatch(OptimConfig()).ended([{"step": 2, "val": {SIM: 1.5}}], 2) is None


def test_the_kept_head_is_strictly_the_best_or_the_latest_without_scores():
    state = TrainState(step=2)
    assert keeps(state, 1.5) and (state.best_score, state.best_step) == (1.5, 2)
    state.step = 4
    assert not keeps(state, 1.5) and not keeps(state, 1.2) and state.best_step == 2
    state.step = 6
    assert keeps(state, None) and (state.best_score, state.best_step) == (float("-inf"), 6)


def test_a_later_head_within_the_noise_of_the_best_is_kept_and_the_bar_stays():
    """Decoded validation is noisy: a later head within `margin` of the best is kept, but the
    best score stays the bar, so heads that each fall a little are not followed down."""
    state = TrainState(step=2)
    assert keeps(state, 1.365, 0.075) and state.best_score == 1.365
    state.step = 4
    assert keeps(state, 1.30, 0.075) and (state.best_score, state.best_step) == (1.365, 4)
    state.step = 6
    assert not keeps(state, 1.28, 0.075) and state.best_step == 4  # 1.28 < 1.365 - 0.075
    assert selection_margin({DECODED: 1.3, DECODED_SE: 0.05}, "decoded") == pytest.approx(0.05 * 2**0.5)
    assert selection_margin({SIM: 1.3, DECODED_SE: 0.05}, "simulated") == 0.0


def test_the_report_summary_is_the_summary_json_record():
    spent = BetweenSteps(validate_s=1.5, validations=3, val_decode_s=0.6, decoded_validations=3,
                         checkpoint_s=0.5, checkpoints=1)
    kept = {"step": 6, "simulated": 1.5, "decoded": 1.2}
    report = FitReport(
        world_size=1, replica_checksums=[0.5], steps=8, best_score=1.2, best_step=6,
        select_by="decoded", kept_validation=kept, skipped_steps=0, acceptance_collapse=None,
        train_tokens_per_s=10.0,
        step_tokens_per_s=12.0, tokens_per_step=64.0, between_steps=spent, data_wait_fraction=0.1,
        head_dir=Path("run/head"),
    )
    summary = report.summary()
    assert list(summary) == [
        "world_size", "replica_checksums", "steps", "best_score", "best_step", "select_by",
        "kept_validation", "skipped_steps", "acceptance_collapse", "train_tokens_per_s", "step_tokens_per_s",
        "tokens_per_step", "between_steps", "data_wait_fraction", "head_dir",
    ]
    assert summary["head_dir"] == "run/head" and summary["between_steps"] == {
        "validate_s": 1.5, "validations": 3, "val_decode_s": 0.6, "decoded_validations": 3,
        "save_best_s": 0.0, "best_saves": 0, "checkpoint_s": 0.5, "checkpoints": 1,
    }
    assert summary["kept_validation"] == kept
    assert spent.per_validation() == 0.5 and spent.per_checkpoint() == 0.5
    assert spent.per_decoded_validation() == pytest.approx(0.2) and spent.seconds == pytest.approx(2.6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.steps = 9
