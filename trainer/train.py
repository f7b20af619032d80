"""The main job: `python -m trainer.train +head=eagle3` (or `+head=medusa`).

prepare data (if its cache is missing) -> train -> evaluate -> export, then say where all went.
Every rank runs this file and holds its own target (online it computes the hidden states of the
rank's batches); rank 0 prepares data first, evaluates, exports and prints. Several nodes work
alike, over a shared file system or each with its own copy of the data (see `prepare_data`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from conf.compose import hydra_main
from conf.errors import UserError, exit_on_user_error
from conf.schema import RootConfig, to_root_config
from data_prep.masks import attention_layout
from data_prep.target import Target, resolve_target
from heads.kinds import check_export_formats
from trainer.checkpoint import latest_checkpoint
from trainer.kind_builders import build_trainee


def prepare_data(cfg: RootConfig, acc, target: Target, model) -> Path:
    """The data folder on every rank, built once per file system: global rank 0 first; then the
    first rank of each other node reuses it (a shared file system) or builds its own copy
    (node-local disks, from the same config the same bytes); then every other rank reuses its
    node's. A barrier closes each turn."""
    from data_prep.prepare import prepare

    turn = 0 if acc.is_main_process else 1 if acc.is_local_main_process else 2
    folder = None
    for now in range(3):
        if now == turn:
            folder = prepare(cfg, target=target, model=model)
        acc.wait_for_everyone()
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


def plan_budget(cfg: RootConfig, acc, target: Target, model, started: float) -> dict | None:
    """`budget=...` (`trainer.plan`): size the data and epochs from measured rates, or None when
    there is no budget or explicit sizes switched it off. The probes run in one process, so a
    multi-process run keeps the sizes' defaults and says so."""
    if cfg.plan_budget_s is None:
        return None
    if acc.num_processes > 1:
        if acc.is_main_process:
            print(f"budget={cfg.budget}: not planned across {acc.num_processes} processes; "
                  f"data.max_samples={cfg.data.max_samples}, optim.epochs={cfg.optim.epochs}")
        return None
    from trainer.plan import plan_run

    return plan_run(cfg, target, model, started)


def decodes_on_static_caches(cfg: RootConfig) -> bool:
    """Whether this run decodes with draftsmith's own engine or decoder (regeneration on the
    `hf` backend, decoded validation, the evaluation), which mask the target's attention
    themselves and refuse what they cannot mask."""
    regen = cfg.data.regenerate
    own_regen = regen.enabled and regen.backend == "hf"
    return own_regen or cfg.optim.val_decode_prompts > 0 or cfg.pipeline.evaluate


def run(cfg: RootConfig) -> dict:
    from data_prep.prepare import check_source
    from data_prep.store import CapturedDataset, load_manifest, online_capture
    from trainer.distributed import build_accelerator
    from trainer.loop import fit
    from trainer.val_decode import build_val_decoder

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    if cfg.resume and latest_checkpoint(run_dir) is None:
        raise UserError(
            f"resume=true: no checkpoint under {run_dir}/checkpoints to resume from "
            "(drop resume=true to start afresh, or point run_dir at the interrupted run)"
        )
    check_source(cfg)
    torch.manual_seed(cfg.seed)
    acc = build_accelerator(cfg.dist, cfg.optim, str(run_dir))
    if cfg.target.device == "auto":
        cfg.target.device = str(acc.device)
    target = resolve_target(cfg)  # once: every stage below gets this one
    if decodes_on_static_caches(cfg):
        attention_layout(target.config)  # refused before any weights load
    model = target.load_model(cfg.target)
    stages = Stages(started)
    budget = plan_budget(cfg, acc, target, model, started)
    if budget is not None:
        stages.done("probes")
    data_dir = prepare_data(cfg, acc, target, model)
    stages.done("data")
    manifest = load_manifest(data_dir)
    train_ds = CapturedDataset(data_dir, "train")
    val_ds = CapturedDataset(data_dir, "validation")
    samples = sum(s["samples"] for s in manifest["splits"].values())
    deadline = None
    if budget is not None:
        from trainer.plan import recheck, training_deadline

        recheck(cfg, budget, started, train_ds, val_ds, samples)
        deadline = training_deadline(budget, started)
    trainee = build_trainee(cfg, model, data_dir)
    val_decode = build_val_decoder(cfg, trainee, (model, target.tokenizer), val_ds)
    capture = online_capture(manifest, model)
    result = fit(cfg, acc, trainee, train_ds, val_ds, run_dir, capture, val_decode, deadline)
    if budget is not None:
        from trainer.plan import note_stop

        note_stop(cfg, budget, result["steps"])
    stages.done("train")
    summary = {
        "run_dir": str(run_dir),
        "data_dir": str(data_dir),
        "hidden_states": manifest.get("hidden_states", "offline"),
        "data_samples": samples,
        "data_tokens": sum(s["tokens"] for s in manifest["splits"].values()),
        **result,
    }
    if acc.is_main_process:
        if cfg.pipeline.evaluate:
            from trainer.evaluate.run import evaluate

            report = evaluate(cfg, result["head_dir"], run_dir / "eval", target=target, model=model)
            summary["eval_dir"] = str(run_dir / "eval")
            summary["mean_acceptance_length"] = report["overall"]["mean_acceptance_length"]
            stages.done("evaluate")
        if cfg.pipeline.export:
            from heads.export import export_head, formats_for

            eval_json = run_dir / "eval" / "eval.json"
            out_root = Path(cfg.export.out_dir or run_dir / "export")
            summary["exports"] = [
                str(
                    export_head(
                        result["head_dir"],
                        fmt,
                        out_root / fmt,
                        target_model=model,
                        eval_json=eval_json if eval_json.exists() else None,
                        dtype=cfg.export.dtype,
                        num_speculative_tokens=cfg.eval.num_speculative_tokens,
                        license=cfg.export.license,
                    )[0]
                )
                for fmt in formats_for(result["head_dir"], cfg.export.formats)
            ]
            stages.done("export")
        summary["stages_s"] = stages.seconds
        if budget is not None:
            summary["budget"] = budget
        summary["wall_time_s"] = round(time.perf_counter() - started, 1)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        print(json.dumps(summary, indent=2))
    acc.end_training()
    return summary


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
@exit_on_user_error
def main(dict_cfg: DictConfig) -> None:
    cfg = to_root_config(dict_cfg)
    check_export_formats(cfg)
    run(cfg)


if __name__ == "__main__":
    hydra_main(main, check_export_formats)
