"""The main job's time budget: how much data and how many epochs fill `budget=20m` on this machine.

A head's acceptance follows its data, and what a budget buys depends on the target and the
machine (bf16 GEMMs or not, a GPU or two cores), so the plan is made from rates measured where it
runs, before the data stage:

1. regeneration: the first `regenerate.batch_size` conversations are answered by the engine, as
   the data stage would (their answers land in the regeneration cache, so the probe costs nothing
   the run would not spend anyway);
2. capture and training: a small data folder of those conversations (at least `PROBE_SAMPLES`,
   enough for `PROBE_STEPS` steps) is captured (the capture rate: the target's bare forward plus
   storage) and the chosen head trains `PROBE_STEPS` steps on it with the real loop (the training
   rate, online capture included);
3. evaluation: the evaluator's greedy decoder writes a few tokens of its first prompt (the per-token
   cost, times the tokens the evaluator decodes: greedy, speculative and the `generate` reference).

`make_plan` then picks the conversations that fill what is left of the budget, at the epochs the
policy gives (`policy_epochs`), counting answers already in the regeneration cache as free, and
keeps `MARGIN` back for export and the rates' noise. After the data stage the plan is checked
again with the time really spent (`fit_steps`): the training steps are trimmed to what is left, or
grown up to `MAX_EPOCHS` when the source ran out of conversations; and training stops at its
deadline (`training_deadline`) if it still runs slower than measured. Everything the plan used and
what each stage then took goes into summary.json; the plan also goes into the run_dir's
plan.json, which `resume=true` follows instead of planning again.

The policy was measured on the embedded default (evaluator, 3 prompts per task): at equal time
more conversations beat more epochs (560 x 2 epochs scored 1.322 against 1.307 for 192 x 5 and,
in the time of 560 x 2, 1.268 for 600 x 1, so two epochs before more data), and 1,120 x 2 scored
1.43 against 560 x 2's 1.33 (so a longer budget buys conversations, not epochs). Medusa's four
full-vocabulary heads are slow to train on a CPU, and one pass over more data served it best.
The plans the default budgets print, and what they scored, are in the README ("Measured").
"""

from __future__ import annotations

import copy
import gc
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from conf.errors import UserError
from conf.files import atomic_write_text, read_json
from conf.schema import EXPORT_FORMATS, RootConfig
from data_prep.regenerate import read_cache
from data_prep.target import Target

MARGIN = 0.06  # of the budget, kept back for the export and the noise in the measured rates
PROBE_SAMPLES = 48  # conversations in the capture-and-train probe folder
PROBE_STEPS = 6  # training steps timed on it (the first one included: the real run pays it too)
PROBE_TOKENS = 16  # tokens the evaluator's decoder writes to time one token
MAX_EPOCHS = 4  # the most epochs the re-check grows to when the source holds too few conversations
MIN_CONVERSATIONS = PROBE_SAMPLES
EXPORT_BYTES_PER_S = 200e6  # an export writes the head once per format
PLAN_FILE = "plan.json"  # in the run_dir: what a resumed run plans with


@dataclass(frozen=True)
class Rates:
    """What the probes measured; token counts are per conversation of the probed ones."""

    regenerate_tokens_per_s: float  # new tokens; inf when regeneration is off or all cached
    capture_tokens_per_s: float  # inf online: nothing is captured
    train_tokens_per_s: float
    answer_tokens: float  # tokens the target writes per conversation
    row_tokens: float  # tokens per conversation in the data folder (prompts and answers)
    evaluate_s: float
    export_s: float
    cached_conversations: int  # answers already in the regeneration cache (free)
    probe_s: float  # the probes' own time, spent before the plan


@dataclass(frozen=True)
class Plan:
    budget_s: float
    spent_s: float  # before the data stage: loading the target and the probes
    conversations: int
    answers: int
    epochs: int
    regenerate_s: float
    capture_s: float
    train_s: float
    evaluate_s: float
    export_s: float

    @property
    def total_s(self) -> float:
        return (self.spent_s + self.regenerate_s + self.capture_s + self.train_s + self.evaluate_s
                + self.export_s)

    def line(self) -> str:
        def m(s: float) -> str:
            return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"

        return (
            f"plan: {self.conversations:,} conversations x {self.answers} answer"
            f"{'s' if self.answers > 1 else ''}, {self.epochs} epoch{'s' if self.epochs > 1 else ''}: "
            f"probes {m(self.spent_s)}, regenerate ~{m(self.regenerate_s)}, capture ~{m(self.capture_s)}, "
            f"train ~{m(self.train_s)}, evaluate ~{m(self.evaluate_s)}, export ~{m(self.export_s)} "
            f"= {self.total_s / 60:.1f} of {self.budget_s / 60:.0f} min"
        )


def policy_epochs(cfg: RootConfig) -> int:
    """The passes over the data the budget buys first (then more conversations): the head's own
    default, which the policy measurements chose (module docstring)."""
    return cfg.head.DEFAULT_EPOCHS


def make_plan(budget_s: float, spent_s: float, rates: Rates, epochs: int, answers: int,
              train_share: float) -> Plan:
    """The most conversations whose stages fit the budget less `MARGIN`, the probes, evaluation
    and export. Conversations up to `rates.cached_conversations` cost no regeneration.
    `train_share`: the fraction of the data that trains (the rest is validation)."""
    regen = answers * rates.answer_tokens / rates.regenerate_tokens_per_s
    capture = answers * rates.row_tokens / rates.capture_tokens_per_s
    train = epochs * answers * rates.row_tokens * train_share / rates.train_tokens_per_s
    left = budget_s * (1 - MARGIN) - spent_s - rates.evaluate_s - rates.export_s
    cached = rates.cached_conversations
    if left <= cached * (capture + train):
        n = left / (capture + train)
    else:
        n = cached + (left - cached * (capture + train)) / (regen + capture + train)
    n = max(MIN_CONVERSATIONS, int(n))
    return Plan(
        budget_s=budget_s,
        spent_s=spent_s,
        conversations=n,
        answers=answers,
        epochs=epochs,
        regenerate_s=max(0, n - cached) * regen,
        capture_s=n * capture,
        train_s=n * train,
        evaluate_s=rates.evaluate_s,
        export_s=rates.export_s,
    )


def fit_steps(left_s: float, train_tokens: int, train_tokens_per_s: float, steps_per_epoch: int,
              epochs: int, short_of_data: bool) -> tuple[int, int]:
    """(epochs, steps) the training stage gets once the data is built and `left_s` remains for
    training: the planned epochs, trimmed to the steps that fit, or grown (to `MAX_EPOCHS`) when
    the source ran short of the planned conversations. At least one step."""
    fits = left_s * train_tokens_per_s / max(train_tokens, 1)  # epochs that fit
    if short_of_data and fits > epochs:
        epochs = min(MAX_EPOCHS, max(epochs, math.floor(fits)))
    steps = min(epochs * steps_per_epoch, max(1, math.floor(fits * steps_per_epoch)))
    return epochs, steps


# ---- the probes -------------------------------------------------------------------------------


def _probe_config(cfg: RootConfig, samples: int, hidden_states: str, run_dir: Path) -> RootConfig:
    probe = copy.deepcopy(cfg)
    probe.data.max_samples = samples
    probe.data.hidden_states = hidden_states
    probe.run_dir = str(run_dir)
    probe.logging.progress = False
    probe.logging.tensorboard = False
    probe.logging.wandb = "disabled"
    probe.optim.val_decode_prompts = 0
    return probe


def _manifest_rates(folder: Path) -> tuple[dict, float, int]:
    """(manifest, tokens per sample, samples) of a data folder."""
    from data_prep.store import load_manifest

    manifest = load_manifest(folder)
    samples = sum(s["samples"] for s in manifest["splits"].values())
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return manifest, tokens / max(samples, 1), samples


def _regeneration_probe(cfg: RootConfig, target: Target, model, run_dir: Path) -> dict:
    """The first `batch_size` conversations regenerated into the cache (their ids into a
    throwaway online folder): new tokens/s, new and row tokens per conversation, how many
    conversations the cache held before, and how many were probed."""
    from data_prep.prepare import prepare, regen_cache_file

    d = cfg.data
    probed = {"rate": math.inf, "answer_tokens": 0.0, "row_tokens": None, "cached": 0, "samples": 0}
    if not d.regenerate.enabled:
        return probed
    probed["cached"] = len(read_cache(regen_cache_file(cfg, target.identity, target.chat_template)))
    k = max(PROBE_SAMPLES, d.regenerate.batch_size // d.regenerate.num_samples)
    folder = prepare(_probe_config(cfg, k, "online", run_dir), target=target, model=model)
    manifest, probed["row_tokens"], probed["samples"] = _manifest_rates(folder)
    shutil.rmtree(folder, ignore_errors=True)
    stats = manifest["stats"]
    made = stats.get("regenerated_tokens", 0)
    if made:  # else every probed answer was cached: the probe range is free, its rate unknown
        answered = max(1, probed["samples"] - stats.get("regenerated_from_cache", 0))
        probed["rate"] = made / max(stats["regenerate_seconds"], 1e-9)
        probed["answer_tokens"] = made / answered
    return probed


def _train_probe(cfg: RootConfig, target: Target, model, run_dir: Path, samples: int) -> dict:
    """A folder of the first `samples` conversations captured (capture tokens/s) and up to
    `PROBE_STEPS` training steps of the chosen head on it (training tokens/s); also its tokens per
    conversation and the head's bytes."""
    from data_prep.prepare import prepare
    from data_prep.store import CapturedDataset, online_capture
    from trainer.distributed import build_accelerator
    from trainer.loop import fit, steps_per_epoch
    from trainer.train import build_trainee

    probe = _probe_config(cfg, samples, cfg.data.hidden_states, run_dir)
    folder = prepare(probe, target=target, model=model)
    manifest, row_tokens, _ = _manifest_rates(folder)
    train_ds = CapturedDataset(folder, "train")
    steps = min(PROBE_STEPS, steps_per_epoch(train_ds, probe.optim, probe.seed, 1))
    if steps == 0:
        raise UserError(
            f"budget={cfg.budget}: {samples} probe conversations make no training step of "
            f"optim.batch_tokens={cfg.optim.batch_tokens}; size the run yourself with "
            "data.max_samples and optim.epochs (the budget is then off)"
        )
    probe.optim.max_steps = probe.optim.val_every = probe.optim.save_every = steps
    acc = build_accelerator(probe.dist, probe.optim, str(run_dir))
    trainee = build_trainee(probe, model, folder)
    head_bytes = sum(p.numel() for p in trainee.parameters() if p.requires_grad) * 2
    result = fit(probe, acc, trainee, train_ds, CapturedDataset(folder, "validation"), run_dir,
                 online_capture(manifest, model))
    del acc, trainee
    gc.collect()
    shutil.rmtree(folder, ignore_errors=True)
    return {"capture_rate": manifest.get("capture_tokens_per_s", math.inf),
            "train_rate": result["train_tokens_per_s"], "row_tokens": row_tokens, "head_bytes": head_bytes}


def train_probe_samples(cfg: RootConfig, regenerated: dict) -> int:
    """Conversations enough for `PROBE_STEPS` steps (by the regeneration probe's tokens per
    conversation), at least `PROBE_SAMPLES`, at most those the regeneration probe answered (so
    the training probe regenerates nothing more)."""
    o = cfg.optim
    if not regenerated["row_tokens"]:
        return PROBE_SAMPLES
    want = math.ceil((PROBE_STEPS + 1) * o.batch_tokens * o.grad_accum
                     / (regenerated["row_tokens"] * (1 - cfg.data.val_fraction)))
    return max(PROBE_SAMPLES, min(want, regenerated["samples"]))


def _evaluation_probe(cfg: RootConfig, target: Target, model) -> float:
    """Seconds the evaluator will take: the greedy decoder's per-token time on the first prompt,
    times the tokens it decodes (greedy, speculative about as many target forwards' worth, the
    `generate` reference on each task's first prompt, prompt lookup if asked)."""
    from data_prep.target import eos_token_ids
    from trainer.decoding import greedy_generate
    from trainer.evaluate.tasks import encode_all, load_prompts

    if not cfg.pipeline.evaluate:
        return 0.0
    ev = cfg.eval
    encoded = encode_all(target.tokenizer, load_prompts(ev), cfg.data)
    ids, eos = encoded[0][1], eos_token_ids(model, target.tokenizer)
    greedy_generate(model, ids, 4, eos)  # warm-up
    start = time.perf_counter()
    greedy_generate(model, ids, PROBE_TOKENS, ())
    per_token = (time.perf_counter() - start) / PROBE_TOKENS
    tasks = len({task for task, _ in encoded})
    passes = 2 + ("prompt_lookup" in ev.baselines) + (ev.temperature > 0)
    references = len(encoded) if ev.reference == "generate" else tasks
    return per_token * ev.max_new_tokens * (passes * len(encoded) + 1.5 * references)


def measure(cfg: RootConfig, target: Target, model) -> Rates:
    """Run the probes on the run's target and its loaded weights (module docstring)."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir) / "plan-probe"
    try:
        regenerated = _regeneration_probe(cfg, target, model, run_dir)
        trained = _train_probe(cfg, target, model, run_dir, train_probe_samples(cfg, regenerated))
        evaluate_s = _evaluation_probe(cfg, target, model)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    formats = len(cfg.export.formats or EXPORT_FORMATS[cfg.head.name]) if cfg.pipeline.export else 0
    return Rates(
        regenerate_tokens_per_s=regenerated["rate"],
        capture_tokens_per_s=trained["capture_rate"],
        train_tokens_per_s=trained["train_rate"],
        answer_tokens=regenerated["answer_tokens"],
        row_tokens=trained["row_tokens"],
        evaluate_s=evaluate_s,
        export_s=formats * (2 + trained["head_bytes"] / EXPORT_BYTES_PER_S),
        cached_conversations=regenerated["cached"],
        probe_s=time.perf_counter() - started,
    )


def plan_file(cfg: RootConfig) -> Path:
    return Path(cfg.run_dir) / PLAN_FILE


def apply(cfg: RootConfig, record: dict) -> None:
    """Set the sizes a plan record decided (the re-check's steps once it has run)."""
    cfg.data.max_samples = record["plan"]["conversations"]
    cfg.optim.epochs = record["plan"]["epochs"]
    if "recheck" in record:
        cfg.optim.epochs = record["recheck"]["epochs"]
        cfg.optim.max_steps = record["recheck"].get("stopped_at", record["recheck"]["steps"])


def plan_run(cfg: RootConfig, target: Target, model, started: float) -> dict:
    """Measure, plan, print the plan line and set `cfg.data.max_samples` and `cfg.optim.epochs`;
    returns the record summary.json keeps (`plan`, `rates`). A resumed run (`resume=true`) takes
    the interrupted run's record from its run_dir instead: the data folder and the learning-rate
    schedule must be the ones its checkpoints were made with."""
    if cfg.resume and plan_file(cfg).exists():
        record = read_json(plan_file(cfg), "resume=true: the interrupted run's plan")
        apply(cfg, record)
        print(f"plan: {cfg.data.max_samples:,} conversations, {cfg.optim.epochs} epochs, as planned "
              f"before the interruption ({plan_file(cfg)})", flush=True)
        return record
    rates = measure(cfg, target, model)
    plan = make_plan(
        cfg.plan_budget_s,
        time.perf_counter() - started,
        rates,
        policy_epochs(cfg),
        cfg.data.regenerate.num_samples,
        1 - cfg.data.val_fraction,
    )
    record = {"plan": asdict(plan), "rates": asdict(rates)}
    apply(cfg, record)
    atomic_write_text(plan_file(cfg), json.dumps(record, indent=2))
    print(plan.line(), flush=True)
    return record


def note_stop(cfg: RootConfig, record: dict, steps: int) -> None:
    """Training ended at `steps`: before the re-check's count when its deadline cut it short. A
    resumed run then ends there too (plan.json), instead of training what the deadline cut."""
    if steps < record["recheck"]["steps"]:
        record["recheck"]["stopped_at"] = steps
        atomic_write_text(plan_file(cfg), json.dumps(record, indent=2))


def training_deadline(record: dict, started: float) -> float:
    """The `time.perf_counter()` by which training must end for evaluation and export to finish
    within the budget (less `MARGIN`): the loop's last guard when training runs slower than the
    probe measured (a busier machine, longer rows)."""
    plan = record["plan"]
    return started + plan["budget_s"] * (1 - MARGIN) - plan["evaluate_s"] - plan["export_s"]


def recheck(cfg: RootConfig, record: dict, started: float, train_ds, samples: int) -> None:
    """After the data stage (`samples` rows built): set `cfg.optim.max_steps` (and epochs) to what
    the budget has left, with the time really spent so far; the record gains what was decided."""
    from trainer.loop import steps_per_epoch

    if "recheck" in record:  # resumed: decided before the interruption
        return
    plan, rates = record["plan"], record["rates"]
    left = training_deadline(record, started) - time.perf_counter()
    train_tokens = sum(train_ds.lengths)
    per_epoch = steps_per_epoch(train_ds, cfg.optim, cfg.seed, 1)
    short = samples < 0.9 * plan["conversations"] * plan["answers"]  # the source ran out
    epochs, steps = fit_steps(
        left, train_tokens, rates["train_tokens_per_s"], per_epoch, cfg.optim.epochs, short
    )
    cfg.optim.epochs, cfg.optim.max_steps = epochs, steps
    record["recheck"] = {"train_left_s": round(left, 1), "epochs": epochs, "steps": steps,
                         "steps_per_epoch": per_epoch, "short_of_data": short}
    atomic_write_text(plan_file(cfg), json.dumps(record, indent=2))
    if steps < epochs * per_epoch or short:
        print(f"plan: {steps} training steps ({epochs} epochs of {per_epoch}) fit the "
              f"{left / 60:.1f} min left", flush=True)

