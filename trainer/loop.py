"""The one training loop every head kind shares.

A trainee is an nn.Module whose forward(batch) returns {"loss", metric sums...}, with
`summarize(sums) -> {..., "score"}` (higher is better), `param_groups(lr, wd)`,
`save_pretrained(dir, state=None)`, `batch_index` and `drafter(target)` (see
`trainer.trainee.Trainee`). The loop knows nothing else about heads. The kept head is the best by
`optim.select_by`: the simulated `score`, or the acceptance length the built-in decoder measures
on validation prompts (`val_decode`, see `trainer.val_decode`), which `auto` (the default) takes
wherever it runs.

Online (`data.hidden_states=online`) the loop also holds a `capture`: the frozen target's
per-batch forward (`data_prep.folders.store.online_capture`), run on each batch's ids before the
objective, in training and validation. It lives outside the wrapped module, so DDP and ZeRO never
see it, the optimizer never holds it and checkpoints never save it: each rank keeps its replica.
Fed by servers (`data.capture.backend=server`) it asks them for each batch's states, a few batches
ahead on a thread (`ahead`), so that a step does not wait for a round trip to the engine.

A training step reads nothing back from the device: on a GPU each read (`.item()`, a shape that
depends on values) waits for every kernel queued before it, and the GPU idles until the next
ones are launched. Values are read at logging, validation and checkpoint steps only; that is
also where the record of non-finite values each step keeps on the device is read
(`trainer.health`): one stops the run in one line, before anything is kept.

`fit` is one loop over named steps: `optimizer_steps` trains up to each optimizer step, then
`log`, `validate` and `checkpoint` run at their cadences. What they call between steps lives in
modules of its own: the non-finite guard (`trainer.health`), the time budget's deadline
(`trainer.deadline`), the timing of steps and of the work between them (`trainer.costs`),
collapse detection (`trainer.collapse`) and the kept head (`trainer.selection`).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from conf.device_defaults import Cadence
from conf.errors import UserError
from conf.files import atomic_write_text
from conf.schema import OptimConfig, RootConfig
from conf.sizes import Sizes
from data_prep.states.capture import NONFINITE, overflow_message
from trainer.batching import batch_loader, rank_batches, validation_batches
from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.collapse import CollapseWatch
from trainer.costs import BetweenSteps, BetweenStepsClock, Throughput
from trainer.deadline import deadline_stop
from trainer.distributed import prepare
from trainer.health import NonFiniteGuard, NonFiniteWatch, describe, sample_at
from trainer.logger import RunLogger
from trainer.on_policy import OnPolicy, stage_start
from trainer.saving import CheckpointClock, rank0_share
from trainer.selection import (
    DECODED,
    DECODED_SE,
    chosen_by,
    keeps,
    kept_head_dir,
    kept_validation,
    save_best,
    selection_margin,
    selection_score,
)
from trainer.tally import Tally
from trainer.trainee import Batch, BatchIndex

HISTORY = "history.json"  # per-step train loss and validation metrics
Capture = Callable[[Batch], Batch]  # a device batch -> the hidden-state fields it lacks
# the unwrapped trainee -> (decoded acceptance length, its standard error)
ValDecode = Callable[[torch.nn.Module], tuple[float, float]]


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup, then cosine decay to zero."""
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def steps_per_epoch(ds, optim: OptimConfig, seed: int, world: int) -> int:
    """Optimizer steps in one pass over `ds` on each of `world` ranks."""
    return len(rank_batches(ds, optim, seed, 0, 0, world)) // optim.grad_accum


def checked_device_batch(
    batch: Batch, device, capture: Capture | None = None
) -> tuple[Batch, torch.Tensor | None]:
    """A loader batch as the objective reads it, on the device: stored hidden states travel as
    stored (bf16) and widen to float32 there; online, `capture` computes them from the ids. And
    where the capture found them non-finite (`data_prep.states.capture.NONFINITE`; None if it says not).
    A batch that arrives with its states (a `NONFINITE` among its fields: fetched ahead, see
    `ahead`) is not captured again."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    moved = {k: v.float() if v.is_floating_point() else v for k, v in moved.items()}
    if capture is not None and NONFINITE not in moved:
        moved |= capture(moved)
    flag = moved.pop(NONFINITE, None)
    return moved, flag


def ahead(capture: Capture | None, loader) -> Iterable[Batch]:
    """The loader's batches, each with its states where the capture fetches them ahead of the
    step (online from servers: `data_prep.folders.online_engine.ServedCapture.ahead`), else as they are."""
    fetch = getattr(capture, "ahead", None)
    return loader if fetch is None else fetch(loader)


def device_batch(batch: Batch, device, capture: Capture | None = None) -> Batch:
    """`checked_device_batch`'s batch."""
    return checked_device_batch(batch, device, capture)[0]


def _loader(ds, batches: list, optim: OptimConfig, device: torch.device, index: BatchIndex,
            capture: Capture | None = None) -> Iterable[Batch]:
    loader = batch_loader(ds, batches, optim.loader_workers, device.type == "cuda", index, optim.packing)
    return ahead(capture, loader)


@torch.no_grad()
def validation_metrics(
    accelerator, trainee, val_ds, cfg: RootConfig, capture: Capture | None = None, limit: int | None = None
) -> dict[str, float]:
    """The trainee's metrics over this rank's validation batches, at most `limit` of them (None:
    the whole split; `trainer.batching.validation_batches`), reduced over the ranks."""
    model = accelerator.unwrap_model(trainee)
    trainee.eval()
    tally = Tally()
    flags: list[torch.Tensor] = []
    batches = validation_batches(
        val_ds, cfg.optim, cfg.seed, accelerator.process_index, accelerator.num_processes, limit
    )
    for batch in _loader(val_ds, batches, cfg.optim, accelerator.device, model.batch_index, capture):
        moved, flag = checked_device_batch(batch, accelerator.device, capture)
        tally.add(trainee(moved))
        flags += [] if flag is None else [flag]
    trainee.train()
    if flags:
        check_validation_capture(accelerator, flags, val_ds, cfg)
    reduced = tally.reduced(accelerator)
    if not reduced:
        return {}
    metrics = model.summarize(reduced)
    metrics["loss"] = (reduced["loss"] / max(1, len(batches) * accelerator.num_processes)).item()
    return metrics


def check_validation_capture(accelerator, flags: list[torch.Tensor], val_ds, cfg: RootConfig) -> None:
    """Refuse, on every rank alike, validation batches whose online hidden states overflowed,
    naming the layer and the sample. `flags`: one `capture.NONFINITE` per batch of this rank
    (every rank has as many batches), read once here, where validation reads anyway."""
    world, n = accelerator.num_processes, len(flags)
    rows = accelerator.gather(torch.stack(flags)).tolist()  # [world * n, 3]
    hit = next((k for k, (layer, _, _) in enumerate(rows) if layer >= 0), None)
    if hit is None:
        return
    rank, b = divmod(hit, n)
    layer, row, position = rows[hit]
    batch = rank_batches(val_ds, cfg.optim, cfg.seed, 0, rank, world)[b]
    i, position = sample_at(batch, row, position, val_ds.lengths)
    raise UserError(f"validation: {overflow_message(layer, position, describe(val_ds, i))}")


def decoded_validation(accelerator, trainee, val_decode: ValDecode) -> tuple[float, float]:
    """(decoded acceptance length, its standard error): rank 0 decodes
    (`trainer.val_decode.ValDecoder`) while the others wait in the sum that hands every rank
    its values: what follows, keeping the head, is collective and must take the same branch
    everywhere. Greedy decoding draws no random numbers, so resume stays exact."""
    value = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process:
        value += torch.tensor(val_decode(accelerator.unwrap_model(trainee)), dtype=torch.float64,
                              device=accelerator.device)
    tau, se = accelerator.reduce(value, reduction="sum").tolist()
    return tau, se


def replica_checksums(accelerator, trainee) -> list[float]:
    """One number per rank from its trainable weights: data-parallel replicas that silently stopped
    talking to each other show up as different numbers. (ZeRO-3 ranks hold different shards.)"""
    params = [p for p in accelerator.unwrap_model(trainee).parameters() if p.requires_grad]
    local = sum((p.detach().double() * (1 + i % 7)).sum() for i, p in enumerate(params))
    gathered = accelerator.gather(torch.as_tensor([local], device=accelerator.device))
    return [round(v, 6) for v in gathered.tolist()]


def read_history(folder: Path, upto: int) -> list[dict]:
    """The history a run_dir or a checkpoint holds, up to step `upto` ([] where it holds none)."""
    path = folder / HISTORY
    return [h for h in json.loads(path.read_text()) if h["step"] <= upto] if path.exists() else []


def train_step(
    accelerator,
    trainee,
    opt,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    batch: Batch,
    capture: Capture | None = None,
    watch: NonFiniteWatch | None = None,
    tally: Tally | None = None,
    on_policy: Callable[[Batch], Batch] | None = None,
) -> torch.Tensor:
    """One micro-batch from the loader: to the device (through `capture` online), forward,
    backward and, at the end of an accumulation, clip and step. `watch` records on the device
    whether the loss, the gradient norm and the captured hidden states were finite; `tally` adds
    up the trainee's metrics and the gradient norm there, for the tracker's next read. Returns the
    loss as a device tensor, for logging steps to read: nothing here reads the device
    (tests/unit/trainer/test_sync_free.py and test_online.py count), not even the gradient norm, unless
    `optim.skip_nonfinite` asks for it (`NonFiniteWatch`). `on_policy`: what turns the device batch
    into the on-policy rows the step trains on instead (`trainer.on_policy.OnPolicy.transform`)."""
    batch, hidden = checked_device_batch(batch, accelerator.device, capture)
    if on_policy is not None:
        batch = on_policy(batch)
    with accelerator.accumulate(trainee):
        out = trainee(batch)
        loss = out["loss"].detach()
        accelerator.backward(out["loss"])
        norm = accelerator.clip_grad_norm_(params, grad_clip) if accelerator.sync_gradients else None
        if tally is not None:
            tally.add(out)
            if norm is not None:
                tally.add_norm(norm)
        if watch is None or watch.observe(loss, norm, hidden, accelerator.sync_gradients):
            opt.step()
        opt.zero_grad()
    return loss


@dataclass(frozen=True)
class FitReport:
    """What one `fit` did; `summary()` is its part of the run's summary.json."""

    world_size: int
    replica_checksums: list[float]
    steps: int  # the step the run ended at (a resumed run restored the earlier ones)
    best_score: float
    best_step: int
    select_by: str  # what chose the kept head: simulated | decoded
    kept_validation: dict | None  # the kept head's step, simulated and decoded τ (`kept_validation`)
    skipped_steps: int
    acceptance_collapse: dict | None  # `trainer.collapse.CollapseWatch.record`
    train_tokens_per_s: float
    step_tokens_per_s: float  # the steps after the first alone: the work between them apart (`between_steps`)
    tokens_per_step: float  # of this call's steps
    between_steps: BetweenSteps
    data_wait_fraction: float
    head_dir: Path

    def summary(self) -> dict:
        return asdict(self) | {"head_dir": str(self.head_dir)}


@dataclass
class Run:
    """What the named steps of one `fit` share: its arguments, its live `TrainState` and what
    it keeps on the side (the non-finite guard, the history, the loggers, the clocks)."""

    cfg: RootConfig
    accelerator: object
    trainee: torch.nn.Module
    val_ds: object
    run_dir: Path
    capture: Capture | None
    val_decode: ValDecode | None
    state: TrainState
    on_policy: OnPolicy | None  # the on-policy stage (`optim.on_policy`), else None
    guard: NonFiniteGuard
    history: list[dict]
    logger: RunLogger
    bar: tqdm
    collapse: CollapseWatch
    owns_logger: bool  # opened by this fit (closed by it), else its caller's (flushed, left open)
    val_batches: int | None  # the most validation batches per rank (`Cadence`); None: all
    saves: CheckpointClock  # when to checkpoint, by steps or by rank 0's clock
    costs: BetweenStepsClock = field(default_factory=BetweenStepsClock)
    pace: Throughput = field(default_factory=Throughput)
    tally: Tally = field(default_factory=Tally)  # the trainee's metrics since the last logging step

    @property
    def select_by(self) -> str:
        """What the kept head is chosen by in this run (`selection.chosen_by`)."""
        return chosen_by(self.cfg.optim.select_by, self.val_decode is not None)

    def say(self, line: str | None) -> None:
        """Print `line` (None: nothing) once, from rank 0, above the progress bar."""
        if line is not None and self.accelerator.is_main_process:
            tqdm.write(line)


def fit(
    cfg: RootConfig,
    accelerator,
    trainee,
    train_ds,
    val_ds,
    run_dir: Path,
    capture: Capture | None = None,
    val_decode: ValDecode | None = None,
    deadline: float | None = None,
    logger: RunLogger | None = None,
    teacher: Capture | None = None,
) -> FitReport:
    """Train, validating every `val_every` steps (at most the device's `Cadence.val_batches` per
    rank) and checkpointing as `trainer.saving` decides (by steps, or on CUDA by wall time); the
    best head (by `selection_score`) goes to run_dir/head. `capture`: online mode's per-batch
    target forward (None: the data holds the hidden states). `val_decode`: decoded validation
    (`trainer.val_decode`; None: off).
    `deadline`: a `time.perf_counter()` value; the step that ends past it is the last, validated
    and saved as the last step is (`trainer.deadline`; None: train the planned steps).
    `logger`: the main job's tracker, left open for what it logs after training (the
    evaluation, the stage times); None: one of this fit's own, closed when it ends.
    `teacher`: the target's capture of any rows, for the on-policy stage (`optim.on_policy` > 0:
    `trainer.on_policy`), which starts at the step the run's first start fixed."""
    optim, world = cfg.optim, accelerator.num_processes
    per_epoch = steps_per_epoch(train_ds, optim, cfg.seed, world)
    if per_epoch == 0:
        raise UserError(
            f"data: {len(train_ds)} training samples make no full step of "
            f"{world} rank(s) x {optim.grad_accum} accumulation: add data or lower optim.*"
        )
    sizes = Sizes.of(cfg)  # the run's, or the defaults of sizes left unset
    total = sizes.max_steps or sizes.epochs * per_epoch
    trainee, opt, sched, params, state, history = prepare_training(cfg, accelerator, trainee, run_dir, total)
    on_policy = None
    if optim.on_policy > 0:
        if teacher is None:
            raise ValueError("optim.on_policy > 0 needs the target's capture (`teacher`)")
        on_policy = OnPolicy(teacher, cfg.seed)
        if state.on_policy_from is None:
            state.on_policy_from = stage_start(total, optim.on_policy)
    run = start(cfg, accelerator, trainee, train_ds, val_ds, run_dir, capture, val_decode, state, history,
                total, logger, on_policy)
    first_step = state.step
    share = rank0_share(accelerator) if world > 1 else None  # whose clock ends training: rank 0's
    for loss in optimizer_steps(run, train_ds, opt, params, total):
        run.say(run.guard.skip_line())
        sched.step()
        state.step += 1
        run.pace.step_ended()
        run.bar.update(1)
        if (line := deadline_stop(deadline, state.step, total, share, cfg.logging.log_every)) is not None:
            run.say(line)
            total = state.step  # this step is the last: validated and saved as such
        last = state.step == total
        if state.step % cfg.logging.log_every == 0 or last:
            log(run, loss, sched.get_last_lr()[0])
        if state.step % sizes.val_every == 0 or last:
            validate(run)
        if run.saves.due(state.step) or last:
            checkpoint(run)
        if last:
            break
    run.bar.close()
    if run.owns_logger:
        run.logger.close()
    else:
        run.logger.flush()  # on disk now, should what the caller does next fail
    run.say(run.collapse.ended(run.history, state.best_step))
    return report(run, first_step)


def adamw(groups: list[dict], optim: OptimConfig) -> torch.optim.AdamW:
    """The optimizer every run and the training bench use, over the trainee's parameter groups.
    `fused`: one kernel per parameter instead of a pass over main memory per arithmetic op (on a
    CPU six times faster than the foreach default; the update's maths is the same)."""
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), fused=True)


def prepare_training(cfg: RootConfig, accelerator, trainee, run_dir: Path, total: int):
    """(trainee, optimizer, LR schedule, trained parameters, state, history) for `total` steps,
    wrapped by accelerate; with `resume`, restored from the latest checkpoint, with the history
    saved in it (else a fresh `TrainState` and no history)."""
    optim = cfg.optim
    groups = trainee.param_groups(optim.lr, optim.weight_decay)
    opt = adamw(groups, optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, optim.warmup_ratio))
    trainee, opt = prepare(accelerator, cfg.dist, trainee, opt)
    params = [p for g in groups for p in g["params"]]
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt is None:
        return trainee, opt, sched, params, TrainState(), []
    state = load_checkpoint(accelerator, ckpt)
    # The schedule is a function of the step: replay it rather than unpickle it. torch warns
    # that no optimizer step preceded these; here that is the point. (`message` is a regex.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        for _ in range(state.step):
            sched.step()
    return trainee, opt, sched, params, state, read_history(ckpt, state.step)


def start(
    cfg: RootConfig, accelerator, trainee, train_ds, val_ds, run_dir: Path, capture, val_decode,
    state: TrainState, history: list[dict], total: int, logger: RunLogger | None = None,
    on_policy: OnPolicy | None = None,
) -> Run:
    """The `Run` of a fit about to take its first step (`state.step`: a resumed run's next, with
    the `history` its checkpoint kept), logging to `logger` (None: a `RunLogger` of its own)."""
    shown = cfg.logging.progress and accelerator.is_main_process
    cadence = Cadence.of(cfg.optim, accelerator.device.type == "cuda")
    trainee.train()
    return Run(
        cfg, accelerator, trainee, val_ds, run_dir, capture, val_decode, state, on_policy,
        guard=NonFiniteGuard(accelerator, state, train_ds, cfg.optim, cfg.seed, run_dir),
        history=history,
        logger=logger or RunLogger(cfg, run_dir, accelerator.is_main_process),
        bar=tqdm(total=total, initial=state.step, desc="train", disable=not shown),
        collapse=CollapseWatch(cfg.optim),
        owns_logger=logger is None,
        val_batches=cadence.val_batches,
        saves=CheckpointClock(cfg.optim.save_every, cadence.save_every_s, cfg.logging.log_every,
                              rank0_share(accelerator)),
    )


def optimizer_steps(
    run: Run, train_ds, opt, params: list[torch.nn.Parameter], total: int
) -> Iterator[torch.Tensor]:
    """Micro-batches through `train_step` from where `run.state` stands (a resumed epoch starts
    at the batch it stopped before), epoch after epoch, yielding the loss (a device tensor) at the
    end of each optimizer step. The caller counts the step and stops at `total` or before."""
    cfg, acc, state = run.cfg, run.accelerator, run.state
    rank, world = acc.process_index, acc.num_processes
    model, watch = acc.unwrap_model(run.trainee), run.guard.watch
    while state.step < total:
        batches = rank_batches(train_ds, cfg.optim, cfg.seed, state.epoch, rank, world)
        loader = _loader(train_ds, batches[state.batch_in_epoch :], cfg.optim, acc.device, model.batch_index,
                         run.capture)
        for batch in run.pace.waiting(loader):
            run.pace.tokens += int(batch["attention_mask"].sum()) * world  # still on the CPU: no sync
            watch.places.append((state.step + 1, state.epoch, state.batch_in_epoch))
            own = None if run.on_policy is None else run.on_policy.transform(model, batch, state)
            loss = train_step(
                acc, run.trainee, opt, params, cfg.optim.grad_clip, batch, run.capture, watch, run.tally, own
            )
            state.batch_in_epoch += 1
            if acc.sync_gradients:
                yield loss
        if state.batch_in_epoch >= len(batches):
            state.epoch += 1
            state.batch_in_epoch = 0


def log(run: Run, loss: torch.Tensor, lr: float) -> None:
    """A logging step: the mean loss over ranks (a device read, the watch's first), the rate,
    and what the tally summed since the last one (per-position acceptance, the gradient norm)."""
    run.guard.check()
    value = run.accelerator.reduce(loss, reduction="mean").item()
    rate = run.pace.tokens_per_s()
    run.bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{rate:.0f}")
    window = run.tally.read(run.accelerator, run.accelerator.unwrap_model(run.trainee).summarize)
    run.logger.log(run.state.step, {**window, "loss": value, "lr": lr, "tokens_per_s": rate}, "train")
    run.history.append({"step": run.state.step, "loss": value})


def validate(run: Run) -> None:
    """Validation metrics (with `val_decode`, the decoded acceptance length too); the head is
    kept when they beat the kept one, and a collapse they show is named."""
    run.guard.check()
    step, acc = run.state.step, run.accelerator
    with run.costs.timed("validate"):
        metrics = validation_metrics(acc, run.trainee, run.val_ds, run.cfg, run.capture, run.val_batches)
        run.guard.check_validation(metrics, run.val_ds)
    if run.val_decode is not None:
        with run.costs.timed("val_decode"):
            metrics[DECODED], metrics[DECODED_SE] = decoded_validation(acc, run.trainee, run.val_decode)
    run.logger.log(step, metrics, "val")
    shown = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())
    run.say(
        f"step {step}: val {shown} (train {run.pace.tokens_per_s():.0f} tokens/s, "
        f"{run.pace.wait_fraction():.0%} waiting for data)"
    )
    by = run.select_by
    if keeps(run.state, selection_score(metrics, by), selection_margin(metrics, by)):
        with run.costs.timed("save_best"):
            save_best(acc, run.trainee, kept_head_dir(run.run_dir))
    run.say(run.collapse.validated(run.history, metrics, step, run.state.best_step))
    run.history.append({"step": step, "val": metrics})


def checkpoint(run: Run) -> None:
    """A checkpoint of the run as it stands, with its history (after a clean read of the watch:
    no checkpoint holds a diverged state)."""
    run.guard.check()
    with run.costs.timed("checkpoint"):
        run.state.skipped = run.guard.watch.skipped
        history = json.dumps(run.history)
        save_checkpoint(run.accelerator, run.run_dir, run.state, {HISTORY: history})
        if run.accelerator.is_main_process:  # the run_dir's copy, for its readers (training.png)
            atomic_write_text(run.run_dir / HISTORY, history)
    run.saves.saved()


def report(run: Run, first_step: int) -> FitReport:
    """The `FitReport` of a run that ended; its rates count this call's steps (from `first_step`)."""
    pace, spent, state = run.pace, run.costs.spent, run.state
    rates = {
        "train_tokens_per_s": pace.tokens_per_s(),
        "step_tokens_per_s": pace.steady_tokens_per_s(apart_s=spent.seconds),
        "tokens_per_step": pace.tokens / max(state.step - first_step, 1),
        "data_wait_fraction": pace.wait_fraction(),
    }
    return FitReport(
        world_size=run.accelerator.num_processes,
        replica_checksums=replica_checksums(run.accelerator, run.trainee),
        steps=state.step,
        best_score=state.best_score,
        best_step=state.best_step,
        select_by=run.select_by,
        kept_validation=kept_validation(run.history, state.best_step),
        skipped_steps=run.guard.watch.skipped,
        acceptance_collapse=run.collapse.record,
        between_steps=spent,
        head_dir=kept_head_dir(run.run_dir),
        **rates,
    )
