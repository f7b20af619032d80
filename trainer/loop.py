"""The one training loop every head kind shares.

A trainee is an nn.Module whose forward(batch) returns {"loss", metric sums...}, with
`summarize(sums) -> {..., "score"}` (higher is better), `param_groups(lr, wd)`,
`save_pretrained(dir, state=None)`, `batch_index` and `drafter(target)` (see
`trainer.trainee.Trainee`). The loop knows nothing else about heads. The kept head is the best by
`optim.select_by`: the simulated `score`, or the acceptance length the built-in decoder measures
on validation prompts (`val_decode`, see `trainer.val_decode`).

Online (`data.hidden_states=online`) the loop also holds a `capture`: the frozen target's
per-batch forward (`data_prep.store.online_capture`), run on each batch's ids before the
objective, in training and validation. It lives outside the wrapped module, so DDP and ZeRO never
see it, the optimizer never holds it and checkpoints never save it: each rank keeps its replica.

A training step reads nothing back from the device: on a GPU each read (`.item()`, a shape that
depends on values) waits for every kernel queued before it, and the GPU idles until the next
ones are launched. Values are read at logging, validation and checkpoint steps only; that is
also where the record of non-finite values each step keeps on the device is read
(`trainer.health`): one stops the run in one line, before anything is kept.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from conf.errors import UserError
from conf.files import atomic_write_text, disk_full_is_one_line
from conf.schema import OptimConfig, RootConfig
from conf.sizes import Sizes
from data_prep.capture import NONFINITE, overflow_message
from trainer.batching import batch_loader, length_grouped_batches, packed_batches, shard_batches
from trainer.checkpoint import (
    RESUME_THEN,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.health import (
    HIDDEN,
    NonFiniteWatch,
    blame,
    collapse,
    collapse_line,
    describe,
    explain,
    never_rose,
    sample_at,
    stop_line,
)
from trainer.logger import RunLogger
from trainer.trainee import Batch, BatchIndex

HISTORY = "history.json"  # per-step train loss and validation metrics
DECODED = "decoded_acceptance_length"  # the validation metric decoded validation adds
Capture = Callable[[Batch], Batch]  # a device batch -> the hidden-state fields it lacks
ValDecode = Callable[[torch.nn.Module], float]  # the unwrapped trainee -> decoded acceptance length


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup, then cosine decay to zero."""
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _batches(ds, optim: OptimConfig, seed: int, epoch: int, rank: int, world: int):
    grouping = packed_batches if optim.packing else length_grouped_batches
    all_batches = grouping(ds.lengths, optim.batch_tokens, optim.max_batch_size, seed, epoch)
    return shard_batches(all_batches, rank, world)


def steps_per_epoch(ds, optim: OptimConfig, seed: int, world: int) -> int:
    """Optimizer steps in one pass over `ds` on each of `world` ranks."""
    return len(_batches(ds, optim, seed, 0, 0, world)) // optim.grad_accum


def checked_device_batch(
    batch: Batch, device, capture: Capture | None = None
) -> tuple[Batch, torch.Tensor | None]:
    """A loader batch as the objective reads it, on the device: stored hidden states travel as
    stored (bf16) and widen to float32 there; online, `capture` computes them from the ids. And
    where the capture found them non-finite (`data_prep.capture.NONFINITE`; None if it says not)."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    moved = {k: v.float() if v.is_floating_point() else v for k, v in moved.items()}
    if capture is None:
        return moved, None
    captured = capture(moved)
    return moved | {k: v for k, v in captured.items() if k != NONFINITE}, captured.get(NONFINITE)


def device_batch(batch: Batch, device, capture: Capture | None = None) -> Batch:
    """`checked_device_batch`'s batch."""
    return checked_device_batch(batch, device, capture)[0]


def _loader(ds, batches: list, optim: OptimConfig, device: torch.device, index: BatchIndex):
    return batch_loader(ds, batches, optim.loader_workers, device.type == "cuda", index, optim.packing)


def _timed(batches, waited: list[float]):
    """Yield from `batches`, adding the seconds spent waiting for each to waited[0]: the share of
    training time a slow data path costs (on a GPU host it can exceed the step itself)."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        batch = next(it, None)
        waited[0] += time.perf_counter() - start
        if batch is None:
            return
        yield batch


@torch.no_grad()
def validation_metrics(
    accelerator, trainee, val_ds, cfg: RootConfig, capture: Capture | None = None
) -> dict[str, float]:
    model = accelerator.unwrap_model(trainee)
    trainee.eval()
    sums: dict[str, torch.Tensor] = {}
    flags: list[torch.Tensor] = []
    batches = _batches(
        val_ds, cfg.optim, cfg.seed, 0, accelerator.process_index, accelerator.num_processes
    )
    for batch in _loader(val_ds, batches, cfg.optim, accelerator.device, model.batch_index):
        moved, flag = checked_device_batch(batch, accelerator.device, capture)
        out = trainee(moved)
        flags += [] if flag is None else [flag]
        for k, v in out.items():
            v = v.detach().float().reshape(-1)
            sums[k] = sums[k] + v if k in sums else v
    trainee.train()
    if flags:
        check_validation_capture(accelerator, flags, val_ds, cfg)
    if not sums:
        return {}
    reduced = {k: accelerator.reduce(v, reduction="sum") for k, v in sums.items()}
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
    batch = _batches(val_ds, cfg.optim, cfg.seed, 0, rank, world)[b]
    i, position = sample_at(batch, row, position, val_ds.lengths)
    raise UserError(f"validation: {overflow_message(layer, position, describe(val_ds, i))}")


def decoded_validation(accelerator, trainee, val_decode: ValDecode) -> float:
    """Rank 0 decodes (`trainer.val_decode.ValDecoder`) while the others wait in the sum that
    hands every rank its value: what follows, keeping the head, is collective and must take the
    same branch everywhere. Greedy decoding draws no random numbers, so resume stays exact."""
    value = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process:
        value += val_decode(accelerator.unwrap_model(trainee))
    return accelerator.reduce(value, reduction="sum").item()


def selection_score(metrics: dict[str, float], select_by: str) -> float | None:
    """The validation number the kept head is chosen by (higher is better; conf.schema.SELECT_BY):
    the trainee's simulated `score` or the decoded acceptance length. None: no validation data."""
    return metrics.get("score" if select_by == "simulated" else DECODED)


def replica_checksums(accelerator, trainee) -> list[float]:
    """One number per rank from its trainable weights: data-parallel replicas that silently stopped
    talking to each other show up as different numbers. (ZeRO-3 ranks hold different shards.)"""
    params = [p for p in accelerator.unwrap_model(trainee).parameters() if p.requires_grad]
    local = sum((p.detach().double() * (1 + i % 7)).sum() for i, p in enumerate(params))
    gathered = accelerator.gather(torch.as_tensor([local], device=accelerator.device))
    return [round(v, 6) for v in gathered.tolist()]


def save_best(accelerator, trainee, out_dir: Path) -> None:
    """Collective (ZeRO-3 gathers the partitioned weights on every rank); rank 0 writes."""
    state = accelerator.get_state_dict(trainee)
    if accelerator.is_main_process:
        with disk_full_is_one_line(out_dir.parent, RESUME_THEN):
            accelerator.unwrap_model(trainee).save_pretrained(out_dir, state=state)
    accelerator.wait_for_everyone()


def read_history(run_dir: Path, upto: int) -> list[dict]:
    path = run_dir / HISTORY
    return [h for h in json.loads(path.read_text()) if h["step"] <= upto] if path.exists() else []


def write_history(run_dir: Path, history: list[dict]) -> None:
    atomic_write_text(run_dir / HISTORY, json.dumps(history))


def train_step(
    accelerator,
    trainee,
    opt,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    batch: Batch,
    capture: Capture | None = None,
    watch: NonFiniteWatch | None = None,
) -> torch.Tensor:
    """One micro-batch from the loader: to the device (through `capture` online), forward,
    backward and, at the end of an accumulation, clip and step. `watch` records on the device
    whether the loss, the gradient norm and the captured hidden states were finite. Returns the
    loss as a device tensor, for logging steps to read: nothing here reads the device
    (tests/test_sync_free.py and tests/test_online.py count), not even the gradient norm, unless
    `optim.skip_nonfinite` asks for it (`NonFiniteWatch`)."""
    batch, hidden = checked_device_batch(batch, accelerator.device, capture)
    with accelerator.accumulate(trainee):
        out = trainee(batch)
        loss = out["loss"].detach()
        accelerator.backward(out["loss"])
        norm = accelerator.clip_grad_norm_(params, grad_clip) if accelerator.sync_gradients else None
        if watch is None or watch.observe(loss, norm, hidden, accelerator.sync_gradients):
            opt.step()
        opt.zero_grad()
    return loss


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
) -> dict:
    """Train, validating every `val_every` steps; the best head (by `selection_score`) goes to
    run_dir/head. `capture`: online mode's per-batch target forward (None: the data holds the
    hidden states). `val_decode`: decoded validation (`trainer.val_decode`; None: off).
    `deadline` (a `time.perf_counter()` value; the time budget's, `trainer.plan`, which plans
    single-process runs only: ranks would read their clocks apart): a step that ends past it is
    the last, validated and saved as the last step is."""
    optim = cfg.optim
    rank, world = accelerator.process_index, accelerator.num_processes
    per_epoch = steps_per_epoch(train_ds, optim, cfg.seed, world)
    sizes = Sizes.of(cfg)  # the run's, or the defaults of sizes left unset
    total_steps = sizes.max_steps or sizes.epochs * per_epoch
    groups = trainee.param_groups(optim.lr, optim.weight_decay)
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, optim.warmup_ratio))
    trainee, opt = accelerator.prepare(trainee, opt)
    index = accelerator.unwrap_model(trainee).batch_index
    state = TrainState()
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt is not None:
        state = load_checkpoint(accelerator, ckpt)
        # The schedule is a function of the step: replay it rather than unpickle it. torch warns
        # that no optimizer step preceded these; here that is the point. (`message` is a regex.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for _ in range(state.step):
                sched.step()
    logger = RunLogger(cfg.logging, run_dir, accelerator.is_main_process, {})
    head_dir = run_dir / "head"
    bar = tqdm(
        total=total_steps,
        initial=state.step,
        desc="train",
        disable=not (cfg.logging.progress and accelerator.is_main_process),
    )
    # Resumed runs keep the curve of the steps they restore (history.json is written with every
    # checkpoint, so a killed run leaves it as far as its last checkpoint).
    history = read_history(run_dir, state.step) if ckpt is not None else []
    trainee.train()
    tokens, t0, waited = 0, time.perf_counter(), [0.0]
    # Seconds and counts of the work between steps, apart from the steps themselves: the time
    # budget (`trainer.plan`) models them at the cadence of val_every and save_every.
    spent: Counter = Counter()
    first_step = state.step
    params = [p for g in groups for p in g["params"]]
    if per_epoch == 0:
        raise UserError(
            f"data: {len(train_ds)} training samples make no full step of "
            f"{world} rank(s) x {optim.grad_accum} accumulation: add data or lower optim.*"
        )
    # fp16 loss scaling makes non-finite gradients routine (the scaler skips those steps itself).
    grad_norms = accelerator.mixed_precision != "fp16"
    watch = NonFiniteWatch(accelerator.device, state.step, grad_norms, optim.skip_nonfinite, state.skipped)
    checked_at, collapsed = -1, None

    def stop(step: int, problem: str, hint: str | None) -> UserError:
        checkpoint = latest_checkpoint(run_dir)  # written only after a clean `check`: good
        return UserError(stop_line(step, problem, hint, head_dir, state.best_step, checkpoint))

    def explained(fault) -> tuple[str, str | None]:
        """`health.explain` with the fault's batches, rebuilt from the deterministic order."""
        places = [watch.place(fault)] if fault.what == HIDDEN else watch.step_places(fault.step)
        batches = [
            _batches(train_ds, optim, cfg.seed, epoch, fault.rank, world)[i] for _, epoch, i in places
        ]
        return explain(fault, batches, train_ds, optim)

    def check() -> None:
        """Read the watch (once per step): stop at the first non-finite value of any rank."""
        nonlocal checked_at
        if checked_at == state.step:
            return
        checked_at = state.step
        fault = watch.read(accelerator)
        if fault is not None:
            raise stop(fault.step, *explained(fault))
    while state.step < total_steps:
        batches = _batches(train_ds, optim, cfg.seed, state.epoch, rank, world)
        # A resumed epoch starts at the batch it stopped before.
        loader = _loader(train_ds, batches[state.batch_in_epoch :], optim, accelerator.device, index)
        for batch in _timed(loader, waited):
            if state.step >= total_steps:
                break
            tokens += int(batch["attention_mask"].sum()) * world  # still on the CPU: no sync
            watch.places.append((state.step + 1, state.epoch, state.batch_in_epoch))
            last_loss = train_step(
                accelerator, trainee, opt, params, optim.grad_clip, batch, capture, watch
            )
            state.batch_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            skipped = watch.take_skip()
            if skipped is not None:
                problem, hint = explained(skipped)
                if watch.skipped > optim.skip_nonfinite:
                    raise stop(skipped.step, f"{problem}, after {optim.skip_nonfinite} skipped step(s)", hint)
                if accelerator.is_main_process:
                    tqdm.write(
                        f"step {skipped.step}: {problem}: optimizer step skipped "
                        f"({watch.skipped} of optim.skip_nonfinite={optim.skip_nonfinite})"
                    )
            sched.step()
            state.step += 1
            bar.update(1)
            if deadline is not None and state.step < total_steps and time.perf_counter() > deadline:
                if accelerator.is_main_process:
                    tqdm.write(f"step {state.step}: the time the budget left for training is spent; "
                               f"stopping before step {total_steps}")
                total_steps = state.step  # this step is the last: validated and saved as such
            if state.step % cfg.logging.log_every == 0 or state.step == total_steps:
                check()
                loss = accelerator.reduce(last_loss, reduction="mean").item()
                rate = tokens / (time.perf_counter() - t0)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
                logger.log(state.step, {"loss": loss, "lr": sched.get_last_lr()[0]}, "train")
                history.append({"step": state.step, "loss": loss})
            last = state.step == total_steps
            if state.step % sizes.val_every == 0 or last:
                check()
                began = time.perf_counter()
                metrics = validation_metrics(accelerator, trainee, val_ds, cfg, capture)
                if not math.isfinite(metrics.get("loss", 0.0)):  # reduced: alike on every rank
                    every = [list(range(len(val_ds)))]
                    raise stop(state.step, *blame("non-finite validation loss", every, val_ds, optim))
                if val_decode is not None:
                    metrics[DECODED] = decoded_validation(accelerator, trainee, val_decode)
                logger.log(state.step, metrics, "val")
                fell = collapse(history, metrics, state.step)
                history.append({"step": state.step, "val": metrics})
                if accelerator.is_main_process:
                    shown = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())
                    elapsed = time.perf_counter() - t0
                    tqdm.write(
                        f"step {state.step}: val {shown} (train {tokens / elapsed:.0f} tokens/s, "
                        f"{waited[0] / elapsed:.0%} waiting for data)"
                    )
                # Every rank must take the same branch (save_best is collective): decide on the
                # reduced metrics only, never on the file system. No validation data: keep the latest.
                score = selection_score(metrics, optim.select_by)
                spent["validate_s"] += time.perf_counter() - began
                spent["validations"] += 1
                if score is None or score > state.best_score:
                    state.best_score = float("-inf") if score is None else score
                    state.best_step = state.step
                    began = time.perf_counter()
                    save_best(accelerator, trainee, head_dir)
                    spent["save_best_s"] += time.perf_counter() - began
                    spent["best_saves"] += 1
                if fell is not None:
                    fell["message"] = collapse_line(fell, optim, state.best_step)
                    collapsed = collapsed or fell
                    if accelerator.is_main_process:
                        tqdm.write(fell["message"])
            if state.step % optim.save_every == 0 or last:
                check()
                began = time.perf_counter()
                state.skipped = watch.skipped
                save_checkpoint(accelerator, run_dir, state)
                if accelerator.is_main_process:
                    write_history(run_dir, history)
                spent["checkpoint_s"] += time.perf_counter() - began
                spent["checkpoints"] += 1
        if state.batch_in_epoch >= len(batches):
            state.epoch += 1
            state.batch_in_epoch = 0
    bar.close()
    logger.close()
    if collapsed is None:
        collapsed = never_rose(history)
        if collapsed is not None:
            collapsed["message"] = collapse_line(collapsed, optim, state.best_step)
            if accelerator.is_main_process:
                tqdm.write(collapsed["message"])
    elapsed = time.perf_counter() - t0
    between = spent["validate_s"] + spent["save_best_s"] + spent["checkpoint_s"]
    steps = state.step - first_step  # this call's (a resumed run restored the others)
    return {
        "world_size": world,
        "replica_checksums": replica_checksums(accelerator, trainee),
        "steps": state.step,
        "best_score": state.best_score,
        "best_step": state.best_step,
        "select_by": optim.select_by,
        "skipped_steps": watch.skipped,
        "acceptance_collapse": collapsed,
        "train_tokens_per_s": tokens / max(elapsed, 1e-9),
        # the steps alone (validation, best-head saves and checkpoints apart, in `between_steps`)
        "step_tokens_per_s": tokens / max(elapsed - between, 1e-9),
        "tokens_per_step": tokens / max(steps, 1),
        "between_steps": dict(spent),
        "data_wait_fraction": waited[0] / max(elapsed, 1e-9),
        "head_dir": str(head_dir),
    }
