"""The main job: `python -m trainer.train +head=eagle3` (or `+head=medusa`).

prepare data (if its cache is missing) -> train -> evaluate -> export, then say in five lines
where all went (`trainer.closing`; summary.json holds the record, training.png its curves).
Every rank runs this file on its own device; the ranks plan the budget together (`trainer.plan`)
and prepare data together (each its share, `data_prep.conversations.ranks`), then each holds of
the target what it runs (`held_target`: the whole target online, where it computes its batches' states, and on
rank 0 where it decodes; else the few tensors the head reads), rank 0 evaluates, exports and
prints. Several nodes work alike, over a shared file system or each with its own copy of the data
(see `prepare_data`).

`resume=true` (same `run_dir`) goes on after any stop, `kill -9` included: regeneration keeps
each answered conversation (a torn last line is cut) and answers the rest, capture resumes after
the last shard written, training from the last checkpoint with the uninterrupted run's losses,
the plan from plan.json, and an export or a data folder appears whole or not at all
(tests/e2e/test_data_resume.py, test_train.py, test_export.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from conf.compose import hydra_main
from conf.device_defaults import cpu_sized_line
from conf.errors import UserError, exit_on_user_error
from conf.schema import RootConfig, derive, to_root_config
from conf.sizes import Sizes
from data_prep.conversations.ranks import Ranks
from data_prep.folders.folder import DataFolder
from data_prep.folders.online_engine import held_parts, holds_whole, served_capture, served_online
from data_prep.folders.store import CapturedDataset, online_capture, target_capture
from data_prep.masks import attention_layout
from data_prep.prepare import capture_spec, check_source, prepare
from data_prep.states.capture import CaptureSpec
from data_prep.target import Target, check_max_length, data_base, resolve_target
from heads.export.write import default_formats, export_head, formats_for
from heads.kinds import HeadKind, check_export_formats
from trainer.checkpoint import check_layout, checkpoint_step, latest_checkpoint
from trainer.closing import closing_lines
from trainer.distributed import build_accelerator, fast_float32_matmuls
from trainer.evaluate.run import evaluate
from trainer.kinds import build_trainee, check_init_from, check_on_policy
from trainer.logger import RunLogger
from trainer.loop import fit, read_history
from trainer.plan import note_stop, plan_run, recheck
from trainer.plan.memory import check_memory_plan
from trainer.plan.policy import PlanRecord
from trainer.training_plot import plot_training
from trainer.val_decode import decoder_or_off, off_line, resolve_decoding


def prepare_data(cfg: RootConfig, acc, target: Target, kind: HeadKind, ranks: Ranks) -> DataFolder:
    """The data folder on every rank. Where every rank sees the data cache (one node, or a shared
    file system) the ranks build it together, each regenerating and capturing its share
    (`data_prep.conversations.ranks`). Else it is built once per node: global rank 0 first; then the first
    rank of each other node builds its own copy (from the same config the same bytes); then
    every other rank reuses its node's. A barrier closes each turn, on the ranks' gloo group,
    which waits a day: a turn takes as long as regenerating and capturing the whole data set,
    and the training group (NCCL) would abort the waiting ranks after `dist.timeout_min`."""
    if ranks.share_folder(data_base(cfg)):
        return prepare(cfg, target=target, ranks=ranks, kind=kind)
    turn = 0 if acc.is_main_process else 1 if acc.is_local_main_process else 2
    folder = None
    for now in range(3):
        if now == turn:
            folder = prepare(cfg, target=target, kind=kind)
        ranks.barrier()
    return folder


class Stages:
    """Seconds each stage of the main job took, for summary.json (and the plan it is held to)."""

    def __init__(self, started: float):
        self.seconds: dict[str, float] = {"load": round(time.perf_counter() - started, 1)}
        self._last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 1)
        self._last = now


def decide_sizes(cfg: RootConfig, acc, target: Target, started: float, kind: HeadKind,
                 ranks: Ranks) -> tuple[Sizes, PlanRecord | None]:
    """The run's sizes, decided once: the user's (or their defaults), or the time budget's plan
    (`trainer.plan`) with its record, the same on every rank (rank 0 plans, the ranks probe
    together). The probes run the whole target here, so a run whose states come from servers
    (`check_served_online`) keeps the user's sizes and says so."""
    if cfg.budget_s is None:
        return Sizes.of(cfg), None
    if served_online(cfg, cfg.data.hidden_states):
        sizes = Sizes.of(cfg)
        if acc.is_main_process:
            print(f"budget={cfg.budget}: not planned with the states from servers; "
                  f"data.max_samples={sizes.conversations}, optim.epochs={sizes.epochs}")
        return sizes, None
    return plan_run(cfg, target, started, kind, ranks)


def decodes_on_static_caches(cfg: RootConfig) -> bool:
    """Whether this run decodes with draftsmith's own engine or decoder (regeneration on the
    `hf` backend, decoded validation, the evaluation), which mask the target's attention
    themselves and refuse what they cannot mask."""
    regen = cfg.data.regenerate
    own_regen = regen.enabled and regen.backend == "hf"
    return own_regen or cfg.val_decode_prompts > 0 or cfg.pipeline.evaluate


def check_decoders(cfg: RootConfig, target: Target, main: bool) -> RootConfig:
    """Refuse a target that draftsmith's decoders cannot mask (`attention_layout`) where this
    run decodes with them, before any weights load. Where decoded validation left to its default
    would be the only one, it goes off instead, in one line (rank 0's): the config it returns."""
    if not decodes_on_static_caches(cfg):
        return cfg
    try:
        attention_layout(target.config, target.attn_implementation)
    except UserError as err:
        if cfg.optim.val_decode_prompts is not None or cfg.optim.select_by == "decoded":
            raise  # asked for
        off = derive(cfg, {"optim.val_decode_prompts": 0})
        if decodes_on_static_caches(off):
            raise
        if main:
            print(off_line(str(err).partition("; use ")[0], cfg.optim.select_by))
        return off
    return cfg


def export_all(cfg: RootConfig, head_dir: Path, run_dir: Path, target_model) -> list[str]:
    """Every export format of the head (or `export.formats`), each into `<out>/<format>`, checked
    against `target_model` (the target, or the parts of it this process holds: `held_target`)."""
    eval_json = run_dir / "eval" / "eval.json"
    out_root = Path(cfg.export.out_dir or run_dir / "export")
    return [
        str(export_head(
            head_dir,
            fmt,
            out_root / fmt,
            target_model=target_model,
            eval_json=eval_json if eval_json.exists() else None,
            push_to_hub=cfg.export.push_to_hub,
            dtype=cfg.export.dtype,
            num_speculative_tokens=cfg.eval.num_speculative_tokens,
            license=cfg.export.license,
            gguf_type=cfg.export.gguf_type,
        )[0])
        for fmt in formats_for(head_dir, cfg.export.formats)
    ]


def check_run_dir(cfg: RootConfig) -> None:
    """One run_dir holds one run. A second run started into it with `resume=false` would mix the
    two (the old run's later checkpoints outlive pruning and a later `resume=true` picks them up;
    its head, plan and summary are overwritten), so it is refused before anything is written, and
    `resume=true` needs a checkpoint to go on from, saved on as many processes and the same ZeRO
    stage (`check_layout`)."""
    run_dir = Path(cfg.run_dir)
    last = latest_checkpoint(run_dir)
    if cfg.resume:
        if last is None:
            raise UserError(
                f"resume=true: no checkpoint under {run_dir}/checkpoints to resume from "
                "(drop resume=true to start afresh, or point run_dir at the interrupted run)"
            )
        check_layout(last, int(os.environ.get("WORLD_SIZE", 1)), cfg.dist.zero_stage)
        return
    if last is not None:
        raise UserError(
            f"run_dir={run_dir} holds a run to step {checkpoint_step(last)}: add resume=true to "
            "continue it, or choose another run_dir"
        )
    kept = [name for name in ("head", "summary.json") if (run_dir / name).exists()]
    if kept:
        held = " and ".join(kept)
        raise UserError(f"run_dir={run_dir} holds an earlier run's {held}: choose another run_dir")


def check_push(cfg: RootConfig, kind: HeadKind) -> None:
    """`export.push_to_hub`: one Hub repo holds one export format, as `heads.export` requires."""
    repo = cfg.export.push_to_hub
    if repo:
        formats = cfg.export.formats or default_formats(kind, vars(cfg.head))
        if len(formats) != 1:
            raise UserError(
                f"export.push_to_hub={repo}: one repo holds one format; add export.formats=[<one of "
                f"{', '.join(formats)}>]"
            )


def check_main_job(cfg: RootConfig) -> HeadKind:
    """What the main job refuses from its config alone, before Hydra writes into run_dir; the
    record of its head's kind, resolved here once for the whole job."""
    kind = check_export_formats(cfg)
    check_push(cfg, kind)
    check_on_policy(cfg)
    if cfg.pipeline.evaluate:
        cfg.target.one_device("the evaluator's speculative decoder", "set pipeline.evaluate=false")
    check_run_dir(cfg)
    return kind


def check_served_online(cfg: RootConfig, spec: CaptureSpec) -> None:
    """`data.hidden_states=online` with `data.capture.backend=server`: the servers compute every
    batch's states and this process holds the head and a few target tensors (`held_parts`),
    so that a target too large for one process trains its head. The stages that run the whole
    target here are refused now, in one line naming the override that turns each off, rather
    than loading the target when they run: a user who serves the target most often cannot load
    it here, and would learn so after training, or swap the node to a halt. (The time budget's
    planner, which also times the whole target, is skipped with a line: `decide_sizes`, since
    `budget` is on by default.) Config alone decides
    it, before data prep or any weights. (`auto` does not know its mode yet: it holds the target
    as before, and its online batches come from the servers all the same.)"""
    if not served_online(cfg, cfg.data.hidden_states):
        return
    if not spec.needs_forward:
        return  # Medusa-2 trains the target itself: it holds it whatever the backend
    why = ("data.hidden_states=online with data.capture.backend=server keeps the target's layers out of this "
           "process (the servers compute the states)")
    if not cfg.data.capture.endpoints:
        raise UserError(f"data.capture.endpoints=[]: {why}; list the servers that serve the target "
                        "(scripts/serve_vllm.py prints the command)")
    if cfg.pipeline.evaluate:
        raise UserError(f"pipeline.evaluate=true: the evaluation decodes with the whole target here, and "
                        f"{why}: set pipeline.evaluate=false (scripts/check_vllm.py evaluates on vLLM)")
    if cfg.optim.val_decode_prompts:
        raise UserError(f"optim.val_decode_prompts={cfg.optim.val_decode_prompts}: decoded validation runs "
                        f"the whole target here, and {why}: set optim.val_decode_prompts=0")


def held_target(cfg: RootConfig, target: Target, spec: CaptureSpec, hidden_states: str, main: bool):
    """What this process holds of the target while it trains, decided once the data is there
    (data prep may have run the whole target, and a vLLM engine may have had the device):
    the whole target, loaded once (`Target.model`), where it computes states, trains the target
    or decodes (`holds_whole`); else the parts its head reads (`held_parts`), and the whole
    target, if data prep loaded it here, is dropped."""
    if holds_whole(cfg, spec, hidden_states, main):
        return target.model
    target.release()
    return held_parts(target, spec)


def run(cfg: RootConfig) -> dict:
    """The main job on `cfg` (left as it is: the sizes decided here go on in a derived config,
    which config.json records)."""
    started = time.perf_counter()
    kind = check_main_job(cfg)  # the head kind's record, resolved once: every stage below gets it
    run_dir = Path(cfg.run_dir)
    check_source(cfg)
    torch.manual_seed(cfg.seed)
    acc = build_accelerator(cfg.dist, cfg.optim, str(run_dir))
    fast_float32_matmuls(acc.device.type)
    if acc.is_main_process and (line := cpu_sized_line(cfg, acc.device.type == "cuda")):
        print(line)  # a GPU run on the CPU-sized defaults: the preset, named once
    target = resolve_target(cfg, acc.device)  # once: every stage below gets this one
    cfg = check_decoders(cfg, target, acc.is_main_process)  # refused before any weights load
    kind.check_target(cfg.head, target.config)
    check_max_length(cfg.data.max_length, target.config)
    check_init_from(cfg, target.config)  # head.init_from: refused before any data stage
    spec = capture_spec(cfg, kind, target.config.num_hidden_layers)
    check_served_online(cfg, spec)
    check_memory_plan(cfg, target.config, acc.device)  # a run its device cannot hold: one line
    stages = Stages(started)
    ranks = Ranks.from_env()  # the ranks' own gloo group: probes and data prep outlast NCCL's waits
    sizes, budget = decide_sizes(cfg, acc, target, started, kind, ranks)
    if budget is not None:
        stages.done("probes")
    asked, cfg = cfg, sizes.apply(cfg)
    cfg, line = resolve_decoding(cfg, None if budget is None else budget.plan.decode_prompts)
    if line is not None and acc.is_main_process:
        print(line)
    data = prepare_data(cfg, acc, target, kind, ranks)
    stages.done("data")
    train_ds = CapturedDataset(data.path, "train")
    val_ds = CapturedDataset(data.path, "validation")
    if budget is not None:
        sizes, budget = recheck(cfg, budget, started, train_ds, val_ds, data.samples, ranks)
        cfg = sizes.apply(cfg)
    model = held_target(cfg, target, spec, data.hidden_states, acc.is_main_process)
    trainee = build_trainee(cfg, model, data.path)
    cfg, val_decode, line = decoder_or_off(asked, cfg, trainee, (model, target.tokenizer), val_ds)
    if line is not None and acc.is_main_process:
        print(line)
    if served_online(cfg, data.hidden_states):
        capture = served_capture(cfg, target, data.manifest, model)
    else:
        capture = online_capture(data.manifest, model)
    plan = None if budget is None else budget.as_dict()
    tracker = RunLogger(cfg, run_dir, acc.is_main_process, plan=plan)  # finished after evaluation
    teacher = target_capture(data.manifest, model) if cfg.optim.on_policy else None
    result = fit(cfg, acc, trainee, train_ds, val_ds, run_dir, capture, val_decode, sizes.deadline, tracker,
                 teacher)
    if budget is not None:
        budget = note_stop(cfg, budget, result.steps)
    stages.done("train")
    summary = {
        "run_dir": str(run_dir),
        "data_dir": str(data.path),
        "hidden_states": data.hidden_states,
        "data_samples": data.samples,
        "data_tokens": data.tokens,
        **result.summary(),
    }
    if acc.is_main_process:
        report = None
        plot_training(read_history(run_dir, result.steps), run_dir / "training.png")
        if cfg.pipeline.evaluate:
            report = evaluate(cfg, result.head_dir, run_dir / "eval", target=target,
                              kept=result.kept_validation)
            summary["eval_dir"] = str(run_dir / "eval")
            summary["mean_acceptance_length"] = report["overall"]["mean_acceptance_length"]
            stages.done("evaluate")
        if cfg.pipeline.export:
            summary["exports"] = export_all(cfg, result.head_dir, run_dir, model)
            stages.done("export")
        summary["stages_s"] = stages.seconds
        tracker.finish(result.steps, stages.seconds, report)
        # not the deadline: a clock reading of this process, meaningless in a file
        summary["sizes"] = {k: v for k, v in dataclasses.asdict(sizes).items() if k != "deadline"}
        if budget is not None:
            summary["budget"] = budget.as_dict()
        summary["wall_time_s"] = round(time.perf_counter() - started, 1)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        print("\n".join(closing_lines(summary, report)))
    acc.end_training()
    return summary


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
@exit_on_user_error
def main(dict_cfg: DictConfig) -> None:
    run(to_root_config(dict_cfg))


if __name__ == "__main__":
    hydra_main(main, check_main_job)
