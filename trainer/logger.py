"""The run's tracker, TensorBoard and wandb, from rank 0; wandb never goes online unless told to.

What a run leaves in both (tests/unit/trainer/test_tracker.py reads it back):
- hyperparameters: the whole checked config (dotted keys, `optim.lr`) and, under a time budget,
  the plan's record (`plan.*`, plan.json's): wandb's config; in TensorBoard the HParams
  dashboard (runs side by side against `eval/overall/tau` and the validation score) and the
  Text tab (one run's config and plan whole, as JSON);
- a run name: `logging.run_name`, else from the run_dir's name and the head kind;
- `train/`: loss, lr, tokens_per_s, grad_norm and the trainee's metrics over the steps since the
  last logging step (`trainer.tally`): acceptance per draft position (`acc_k`; Medusa heads
  `top1_k`), the simulated acceptance length; `val/`: the same metrics on validation, its loss;
- after evaluation, at the last step: `eval/<task>/tau`, `eval/overall/tau`, `eval/lossless`
  and the main job's stage times, `stages/<stage>_s`.

One run keeps one wandb id, in run_dir/wandb_id: `resume=true` continues that wandb run (its
steps go on from the checkpoint's); a fresh run takes a new id. (Offline, a resumed run is a
second offline-run-* folder with the same id; `wandb sync` uploads both into one run.)
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict
from pathlib import Path

from conf.files import atomic_write_text
from conf.schema import RootConfig

WANDB_ID = "wandb_id"  # in the run_dir
HPARAM_METRICS = ("eval/overall/tau", "val/score", "val/loss")  # the HParams dashboard's columns


class RunLogger:
    """The tracker of one run (of one process: resumed, the same wandb run goes on). Disabled
    (`enabled=False`, every rank but 0) it holds nothing and every call is a no-op."""

    def __init__(self, cfg: RootConfig, run_dir: Path, enabled: bool, plan: dict | None = None):
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        name, config = run_name(cfg, run_dir), asdict(cfg)
        hparams = {**config, "plan": plan} if plan else config
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            write_hparams(self.tb, name, hparams, {"config": config, "plan": plan})
        if cfg.logging.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                mode=cfg.logging.wandb,
                dir=str(run_dir),
                name=name,
                id=wandb_run_id(run_dir, cfg.resume),
                resume="allow",
                config=hparams,
            )

    def log(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        """`metrics` at `step`, each named `<prefix>/<name>` (no prefix: as given)."""
        if not self.enabled:
            return
        named = {f"{prefix}/{k}" if prefix else k: v for k, v in metrics.items()}
        if self.tb is not None:
            for k, v in named.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(named, step=step)

    def finish(self, step: int, stages_s: dict[str, float], report: dict | None) -> None:
        """The main job's last record, at the run's last `step`, then close: the evaluation
        (`report`, eval.json's object; None: not evaluated): τ per task and overall, whether
        decoding was lossless; and the seconds each stage took (`trainer.train.Stages`)."""
        metrics = {f"stages/{stage}_s": s for stage, s in stages_s.items()}
        if report is not None:
            scored = {**report["tasks"], "overall": report["overall"]}
            metrics |= {
                f"eval/{task}/tau": r["mean_acceptance_length"]
                for task, r in scored.items()
                if r["mean_acceptance_length"] is not None  # no drafts: no τ
            }
            metrics["eval/lossless"] = float(report["lossless"])
        self.log(step, metrics)
        self.close()

    def flush(self) -> None:
        """What TensorBoard buffers, to disk (wandb streams as it goes)."""
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def run_name(cfg: RootConfig, run_dir: Path) -> str:
    """`logging.run_name`, else the run_dir's name, with the head kind where that name lacks it
    (the default run_dir, outputs/<head>, is named after it already)."""
    if cfg.logging.run_name:
        return cfg.logging.run_name
    head = getattr(cfg.head, "name", None)
    name = Path(run_dir).resolve().name
    return name if head is None or head in name else f"{name}-{head}"


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The wandb run this run logs to: with `resume`, the one run_dir/wandb_id names (the
    interrupted run's); else a new one, written there for a later `resume=true`."""
    path = run_dir / WANDB_ID
    if resume and path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # wandb's alphabet: lowercase letters and digits
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, run_id)
    return run_id


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    """Nested dicts as dotted keys (`optim.lr`), leaves as TensorBoard's HParams take them:
    numbers, strings and booleans as they are, anything else (lists, null) as its JSON text."""
    out: dict[str, object] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flat(v, f"{key}.")
        else:
            out[key] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out


def write_hparams(tb, name: str, hparams: dict, texts: dict[str, dict | None]) -> None:
    """The run's hyperparameters into its own event file: the HParams dashboard (one row per
    run, its columns `HPARAM_METRICS` read from the run's scalars), and in the Text tab its
    name and each of `texts` (None: left out) whole, as indented JSON, which Markdown shows as
    code: a run's config is read there, not across a hundred columns."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    metrics = dict.fromkeys(HPARAM_METRICS, 0.0)  # names only: the values are the scalars'
    for summary in hparams_summaries({"run_name": name, **flat(hparams)}, metrics):
        tb.file_writer.add_summary(summary)
    tb.add_text("run", name)
    for tag, tree in texts.items():
        if tree is not None:
            text = json.dumps(tree, indent=2)
            tb.add_text(tag, "\n".join(f"    {line}" for line in text.splitlines()))
