"""The main job's time budget: how much data and how many epochs fill `budget=20m` on this machine.

A head's acceptance follows its data, and what a budget buys depends on the target and the
machine (bf16 GEMMs or not, a GPU or two cores), so the plan is made from rates measured where it
runs, before the data stage:

1. regeneration: the first conversations the regeneration cache lacks, as many as the engine
   holds at once (`planned_slots`, at least `PROBE_SAMPLES`), are answered by the engine, as the
   data stage would (their answers land in the cache, so the probe costs nothing the run would
   not spend anyway; the cached conversations are free, counted where they are among the
   selected ones, `data_prep.rows.cached_spans`). The engine times its steps, and the plan prices the run's
   regeneration by replaying the engine's schedule for that many more answers like the probe's
   (`RegenShape`, `data_prep.regen_cost`): one batch runs at another rate than a batch and a
   half, whose last half thins. Another backend (vLLM, servers) is priced at the probe's rate;
2. capture and training: a small data folder of those conversations (at least `PROBE_SAMPLES`,
   enough for `PROBE_STEPS` steps) is captured (the capture rate: the target's bare forward plus
   storage, its one-off set-up apart; with one pass, `data_prep.onepass`, reading back what the
   regeneration probe kept, which the run's answers will be too, as the probes keep their states
   for the run) and the chosen head trains `PROBE_STEPS` steps on it with
   the real loop. The loop times its steps apart from what runs between them, so the plan has
   the training rate (online capture included), the seconds a validation takes per validation
   token, and what saving the best head and a checkpoint cost: a full-vocabulary Medusa head
   saves hundreds of MB, and validation grows with the data, so both are modelled at the
   cadence of `optim.val_every` and `optim.save_every` (`train_cost`) rather than averaged
   into the rate of six steps. Unless `optim.val_every` is given, the plan also sets it
   (`planned_val_every`): a long run validates about `VALIDATIONS` times, not every 50 steps;
3. evaluation: the evaluator's greedy decoder, and its speculative decoder with the head the probe
   trained, each write a few tokens of its first prompt, and of its longest where the
   long-context task (`eval.context_lengths`) makes prompts longer (prefill and per-token costs,
   each prompt priced by its length, times the tokens the evaluator decodes). The barely
   trained head accepts about nothing, so its per-token cost is the cost of one verify step: an
   upper bound for a trained head, and a Medusa tree's verify step costs several greedy tokens
   on a CPU.

`make_plan` then picks the conversations that fill what is left of the budget, at the epochs the
policy gives (`policy_epochs`), counting answers already in the regeneration cache as free, and
keeps `MARGIN` back for export and the rates' noise. After the data stage the plan is checked
again with the time really spent (`fit_steps`): the training steps are trimmed to what is left, or
grown up to `MAX_EPOCHS` when the source ran out of conversations; and training stops at its
deadline (`training_deadline`) if it still runs slower than measured. Everything the plan used and
what each stage then took goes into summary.json; the plan also goes into the run_dir's
plan.json, which `resume=true` follows instead of planning again.

The planner keeps its word or says so, before the data stage: probes that take more than
`PROBE_SHARE` of the budget stop the job (`_within_share`), and so does a plan whose smallest size
(`MIN_CONVERSATIONS`) still overruns the budget, in one line naming its largest stage and the
settings that would fit (`unmet_line`: a larger `budget`, fewer `eval.max_prompts_per_task` or
`eval.max_new_tokens` when evaluation is the largest, or explicit sizes). What the plan decides is
one frozen `conf.sizes.Sizes`; the run goes on with `Sizes.apply(cfg)`, a derived config, and the
user's config is never written.

The policy was measured on the embedded default (evaluator, 3 prompts per task, 2026-12-01): at
equal time more conversations beat more epochs (560 conversations x 2 epochs τ 1.322, 192 x 5
1.307, 600 x 1 1.268), so two epochs before more data; longer budgets went to conversations
(`budget=10m` 408 conversations τ 1.304, 20m 872 1.403, 40m 1,860 1.494). Offline capture beat
online on a CPU, since online runs the target in every epoch and buys fewer conversations for the
same time (`budget=10m data.hidden_states=online`: 333 conversations, τ 1.296), so
`data.hidden_states=auto` keeps offline while the disk holds it. The answers per prompt are the
user's `data.regenerate.num_samples`: two sampled answers scored above one greedy answer at 10
minutes (10 prompts per task: 1.311 vs 1.289, higher on all three tasks), one budget on one
target, not yet a default. Medusa's four full-vocabulary heads are slow to train on a CPU, and
one pass over more data served it best.
"""

from __future__ import annotations

import contextlib
import gc
import io
import itertools
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from conf.errors import UserError
from conf.files import atomic_write_text, read_json
from conf.schema import OptimConfig, RootConfig, derive
from conf.sizes import Sizes
from data_prep.folder import DataFolder
from data_prep.keys import regen_cache_file
from data_prep.onepass import one_pass
from data_prep.prepare import capture_spec, prepare
from data_prep.regen_cost import StepCost, generate_seconds
from data_prep.regen_engine import default_workers, planned_slots, timed_steps
from data_prep.regenerate import read_cache
from data_prep.rows import Spans, cached_before, cached_spans, uncached_prefix
from data_prep.store import CapturedDataset, online_capture
from data_prep.target import Target
from heads.kinds import head_kind
from trainer.decoding import GREEDY, greedy_generate, speculative_generate
from trainer.distributed import build_accelerator
from trainer.evaluate.run import draft_shape, eval_prompts, load_drafter, pass_schedule, resolve_mode
from trainer.kinds import build_trainee
from trainer.loop import fit, steps_per_epoch

MARGIN = 0.06  # of the budget, kept back for the export and the noise in the measured rates
PROBE_SAMPLES = 48  # conversations in the capture-and-train probe folder
PROBE_STEPS = 6  # training steps timed on it (the first one included: the real run pays it too)
PROBE_TOKENS = 16  # tokens the evaluator's decoder writes to time one token
MAX_EPOCHS = 4  # the most epochs the re-check grows to when the source holds too few conversations
VALIDATIONS = 10  # a planned run validates about this many times at most (and at its last step)
MIN_CONVERSATIONS = PROBE_SAMPLES
PROBE_SHARE = 0.5  # of the budget, the most the probes may take before the plan is made
GENERATE_COST = 1.5  # transformers' `generate` per token, in greedy decoder tokens
EXPORT_BYTES_PER_S = 200e6  # an export writes the head once per format
PLAN_FILE = "plan.json"  # in the run_dir: what a resumed run plans with


@dataclass(frozen=True)
class Rates:
    """What the probes measured; token counts are per conversation of the probed ones."""

    regenerate_tokens_per_s: float  # new tokens; inf when regeneration is off or all cached
    capture_tokens_per_s: float  # inf online: nothing is captured
    train_tokens_per_s: float  # of the training steps alone
    tokens_per_step: float  # real (unpadded) tokens one optimizer step trains
    validate_s_per_token: float  # one validation's seconds per validation token
    save_best_s: float  # saving the best head once
    checkpoint_s: float  # writing one checkpoint
    answer_tokens: float  # tokens the target writes per conversation
    row_tokens: float  # tokens per conversation in the data folder (prompts and answers)
    evaluate_s: float
    export_s: float
    cached_spans: Spans  # the selected conversations the regeneration cache holds (free)
    probe_s: float  # the probes' own time, spent before the plan
    # the regeneration engine's fitted step cost (`regen_cost.StepCost`); None: another backend
    regenerate_step_cost: dict | None = None


@dataclass(frozen=True)
class RegenShape:
    """What the regeneration probe answered, as the engine's seconds for any number of
    conversations (`data_prep.regen_cost`): its fitted step cost, and per round (a
    conversation's n-th turn) the (prompt tokens, answer tokens) of the cached answers, replayed
    at the same share per sample (an answered conversation). `scale`: the probe's measured
    seconds over its replayed ones, the time around the steps the cost leaves out (admissions,
    the caller's bookkeeping, one engine ending before the other): 3.5% of a probe on SmolLM2."""

    cost: StepCost
    rounds: list[list[tuple[int, int]]]
    samples: int
    batch_size: int
    workers: int
    scale: float = 1.0

    def replay(self, rounds: list[list[tuple[int, int]]]) -> float:
        """The step cost's seconds for these rounds, each ordered as `regenerate` orders them."""
        return sum(generate_seconds(self.cost, sorted(answers), self.batch_size, self.workers)
                   for answers in rounds)

    def seconds(self, samples: int) -> float:
        like = [list(itertools.islice(itertools.cycle(answers), round(len(answers) * samples / self.samples)))
                for answers in self.rounds]
        return self.scale * self.replay(like)


@dataclass(frozen=True)
class Plan:
    budget_s: float
    spent_s: float  # before the data stage: loading the target and the probes
    conversations: int
    answers: int
    epochs: int
    val_every: int
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
        m = _minutes
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


@dataclass(frozen=True)
class Schedule:
    """How the data is trained, besides its size: the policy's epochs and answers per prompt, the
    share of the rows that trains (the rest validates), `optim.val_every` (None: planned,
    `planned_val_every`) and `optim.save_every`."""

    epochs: int
    answers: int
    train_share: float
    val_every: int | None
    save_every: int


def planned_val_every(steps: float) -> int:
    """Every `DEFAULT_VAL_EVERY` steps, or less often so that a long run validates about
    `VALIDATIONS` times: the validation split grows with the data, so at a fixed cadence its
    cost grows with the square of the data (a third of a 40-minute run's training at 50 steps
    apart on the embedded default), while the best head is nearly always one of the last."""
    return max(OptimConfig.DEFAULT_VAL_EVERY, math.ceil(steps / VALIDATIONS))


def between_steps_s(rates: Rates, val_tokens: float, val_every: int, save_every: int) -> tuple[float, float]:
    """(seconds per training step, seconds once at the end) spent validating `val_tokens` and
    saving the best head every `val_every` steps and checkpointing every `save_every`: the last
    step always does both."""
    validation = val_tokens * rates.validate_s_per_token + rates.save_best_s
    return validation / val_every + rates.checkpoint_s / save_every, validation + rates.checkpoint_s


def train_cost(rates: Rates, rows: float, schedule: Schedule) -> tuple[float, int]:
    """(the training stage's seconds, the validation cadence) for `rows` data rows: the steps at
    the measured rate, and validations and saves at their cadence (validation grows with the
    data too, so the seconds grow faster than `rows`)."""
    tokens = rows * rates.row_tokens
    trained = schedule.epochs * tokens * schedule.train_share
    steps = trained / rates.tokens_per_step
    val_every = schedule.val_every or planned_val_every(steps)
    per_step, last = between_steps_s(rates, tokens * (1 - schedule.train_share), val_every,
                                     schedule.save_every)
    return trained / rates.train_tokens_per_s + steps * per_step + last, val_every


def make_plan(budget_s: float, spent_s: float, rates: Rates, schedule: Schedule,
              shape: RegenShape | None = None) -> Plan:
    """The most conversations whose stages fit the budget less `MARGIN`, the probes, evaluation
    and export. Conversations in `rates.cached_spans` cost no regeneration; the rest
    cost what `shape` says the engine takes for them, else (another backend) the probe's rate."""
    answers = schedule.answers
    capture = answers * rates.row_tokens / rates.capture_tokens_per_s
    left = budget_s * (1 - MARGIN) - spent_s - rates.evaluate_s - rates.export_s

    def regen_s(n: int) -> float:
        uncached = n - cached_before(rates.cached_spans, n)
        if shape is not None:
            return shape.seconds(uncached * answers)
        return uncached * answers * rates.answer_tokens / rates.regenerate_tokens_per_s

    def cost(n: int) -> float:
        return regen_s(n) + n * capture + train_cost(rates, n * answers, schedule)[0]

    lo, hi = 0, 1  # the stage costs grow with n: the largest n that fits, by bisection
    while cost(hi) <= left:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= left else (lo, mid)
    n = max(MIN_CONVERSATIONS, lo)
    train_s, val_every = train_cost(rates, n * answers, schedule)
    return Plan(
        budget_s=budget_s,
        spent_s=spent_s,
        conversations=n,
        answers=answers,
        epochs=schedule.epochs,
        val_every=val_every,
        regenerate_s=regen_s(n),
        capture_s=n * capture,
        train_s=train_s,
        evaluate_s=rates.evaluate_s,
        export_s=rates.export_s,
    )


def fit_steps(left_s: float, step_s: float, last_s: float, steps_per_epoch: int, epochs: int,
              short_of_data: bool) -> tuple[int, int]:
    """(epochs, steps) the training stage gets once the data is built and `left_s` remains for
    training, at `step_s` a step (validations and saves spread over the steps) and `last_s` for
    the last step's validation and saves: the planned epochs, trimmed to the steps that fit, or
    grown (to `MAX_EPOCHS`) when the source ran short of the planned conversations. At least one
    step."""
    fits = max(0.0, left_s - last_s) / step_s  # steps
    if short_of_data and fits > epochs * steps_per_epoch:
        epochs = min(MAX_EPOCHS, max(epochs, math.floor(fits / steps_per_epoch)))
    steps = min(epochs * steps_per_epoch, max(1, math.floor(fits)))
    return epochs, steps


# ---- the probes -------------------------------------------------------------------------------


def _probe_config(cfg: RootConfig, samples: int, hidden_states: str, run_dir: Path,
                  progress: bool = False) -> RootConfig:
    """The run's config for a quiet probe of `samples` conversations in `run_dir` (`progress`:
    its bars drawn)."""
    return derive(cfg, {
        "data.max_samples": samples,
        "data.hidden_states": hidden_states,
        "run_dir": str(run_dir),
        "logging.progress": progress,
        "logging.tensorboard": False,
        "logging.wandb": "disabled",
        "optim.val_decode_prompts": 0,
        "optim.select_by": "simulated",
    })


def conversation_tokens(cfg: RootConfig, data: DataFolder, conversations: int) -> float:
    """Tokens per conversation and answer in a probe's folder of the first `conversations`: the
    plan counts conversations, and a multi-turn conversation whose template rewrites its history
    is a row per turn (priced per row, a long-context run's capture came out 40% short: its 124
    conversations were 169 rows). Where the source held fewer, this over-prices a little."""
    return data.tokens / max(1, conversations * cfg.data.regenerate.num_samples)


def answer_rounds(answered: dict[str, list[dict]]) -> list[list[tuple[int, int]]]:
    """Per round of `regenerate` (every conversation's n-th turn), the (prompt tokens, answer
    tokens) of the cached answers (`read_cache`)."""
    rounds: list[list[tuple[int, int]]] = []
    for turns in answered.values():
        for n, turn in enumerate(turns):
            if n == len(rounds):
                rounds.append([])
            rounds[n].append((len(turn["prompt_ids"]), len(turn["answer_ids"])))
    return rounds


def _regeneration_probe(cfg: RootConfig, target: Target, run_dir: Path) -> dict:
    """The first conversations regenerated into the cache, up to as many new ones as the engine
    holds at once (`planned_slots`), at least `PROBE_SAMPLES` (their ids into a throwaway online
    folder): a warm cache's answers are passed over, not taken for the probe (all cached, the
    rate stays unknown and regeneration is priced free). Returns the new tokens/s, new tokens per
    new conversation, the row tokens per conversation, which selected conversations the cache
    holds now (`cached_spans`: free for the run, the probe's among them), how many were probed,
    and the engine's `RegenShape` (None: another backend, or nothing to time)."""
    d = cfg.data
    probed = {"rate": math.inf, "answer_tokens": 0.0, "row_tokens": None, "cached": (), "conversations": 0,
              "shape": None}
    if not d.regenerate.enabled:
        return probed
    tpl = target.chat_template
    cache = regen_cache_file(cfg, target.identity, tpl)
    r = d.regenerate
    workers = r.workers or default_workers(target.model, r.batch_size)
    kept = len(capture_spec(cfg, target.identity["num_hidden_layers"]).layers) if one_pass(cfg) else 0
    slots = planned_slots(target.model, r.batch_size, workers, d.max_length, kept)  # few at long contexts
    before = read_cache(cache)
    size = uncached_prefix(cached_spans(cfg, tpl, before), max(PROBE_SAMPLES, slots // r.num_samples))
    with timed_steps() as timings:
        # The first long wait of a run, and often all its regeneration (a small budget's plan
        # reuses the probe's answers): its bar draws as the run's would.
        probe = _probe_config(cfg, size, "online", run_dir, cfg.logging.progress)
        data = prepare(probe, target=target, keep_states=one_pass(cfg))
    answered = read_cache(cache)
    probed["cached"] = cached_spans(cfg, tpl, answered)  # the probe's answers included: the run reuses them
    cost = StepCost.fit(timings)
    if cost is not None:
        shape = RegenShape(cost, answer_rounds(answered), len(answered), slots, workers)
        new = {uid: turns for uid, turns in answered.items() if uid not in before}
        replayed = shape.replay(answer_rounds(new))
        probed["shape"] = replace(shape, scale=data.stats.regenerate_seconds / replayed if replayed else 1.0)
    probed["row_tokens"], probed["conversations"] = conversation_tokens(cfg, data, size), size
    shutil.rmtree(data.path, ignore_errors=True)
    made = data.stats.regenerated_tokens
    if made:  # else the source held nothing more to answer: the rate stays unknown
        probed["rate"] = data.regenerate_tokens_per_s
        probed["answer_tokens"] = made / max(1, len(answered) - len(before))
    return probed


def _train_probe(cfg: RootConfig, target: Target, run_dir: Path, samples: int) -> dict:
    """A folder of the first `samples` conversations captured (capture tokens/s) and up to
    `PROBE_STEPS` training steps of the chosen head on it, the last validated and saved (the
    rates and costs `Rates` names); also its tokens per conversation and the head's bytes. The
    head it trained stays in run_dir/head for the evaluation probe."""
    probe = _probe_config(cfg, samples, cfg.data.hidden_states, run_dir)
    data = prepare(probe, target=target, keep_states=one_pass(cfg))
    train_ds = CapturedDataset(data.path, "train")
    steps = min(PROBE_STEPS, steps_per_epoch(train_ds, probe.optim, probe.seed, 1))
    if steps == 0:
        raise UserError(
            f"budget={cfg.budget}: {samples} probe conversations make no training step of "
            f"optim.batch_tokens={cfg.optim.batch_tokens}; size the run yourself with "
            "data.max_samples and optim.epochs (the budget is then off)"
        )
    probe = derive(probe, {"optim.epochs": 1, "optim.max_steps": steps, "optim.val_every": steps,
                           "optim.save_every": steps})
    acc = build_accelerator(probe.dist, probe.optim, str(run_dir))
    trainee = build_trainee(probe, target.model, data.path)
    head_bytes = sum(p.numel() for p in trainee.parameters() if p.requires_grad) * 2
    val_ds = CapturedDataset(data.path, "validation")
    capture = online_capture(data.manifest, target.model)
    with contextlib.redirect_stdout(io.StringIO()):  # a few steps' validation lines are not the run's
        result = fit(probe, acc, trainee, train_ds, val_ds, run_dir, capture)
    del acc, trainee
    gc.collect()
    shutil.rmtree(data.path, ignore_errors=True)
    between = result.between_steps
    return {
        "capture_tokens_per_s": math.inf if data.capture_tokens_per_s is None else data.capture_tokens_per_s,
        "train_tokens_per_s": result.step_tokens_per_s,
        "tokens_per_step": result.tokens_per_step,
        "validate_s_per_token": between.per_validation() / max(sum(val_ds.lengths), 1),
        "save_best_s": between.per_best_save(),
        "checkpoint_s": between.per_checkpoint(),
        "row_tokens": conversation_tokens(cfg, data, samples),
        "head_bytes": head_bytes,
    }


def train_probe_samples(cfg: RootConfig, regenerated: dict) -> int:
    """Conversations enough for `PROBE_STEPS` steps (by the regeneration probe's tokens per
    conversation), at least `PROBE_SAMPLES`, at most those the regeneration probe answered (so
    the training probe regenerates nothing more)."""
    o = cfg.optim
    if not regenerated["row_tokens"]:
        return PROBE_SAMPLES
    want = math.ceil((PROBE_STEPS + 1) * o.batch_tokens * o.grad_accum
                     / (regenerated["row_tokens"] * (1 - cfg.data.val_fraction)))
    return max(PROBE_SAMPLES, min(want, regenerated["conversations"]))


def _decode_rates(decode, ids: torch.Tensor, warm: bool) -> tuple[float, float]:
    """(prefill seconds, seconds per further token) of `decode(ids, max_new_tokens)`, from its
    own stats, after a short warm-up where `warm` (the first call pays for allocations)."""
    if warm:
        decode(ids, 4)
    stats = decode(ids, PROBE_TOKENS).stats
    return stats.prefill_s, (stats.total_s - stats.prefill_s) / max(stats.new_tokens - 1, 1)


def evaluation_runs(cfg: RootConfig, tasks: list[str]) -> list[tuple[float, float]]:
    """(greedy-decoder runs, speculative-decoder runs) the evaluator makes of each prompt of
    `tasks`, from its own pass schedule (`trainer.evaluate.run.pass_schedule`): each prompt's
    greedy baseline and speculative run, and the passes the schedule adds (prompt lookup, the
    `generate` reference at `GENERATE_COST`, a sampled run's greedy check). Each run prefills
    the prompt and writes up to `eval.max_new_tokens`."""
    return [(1 + p.lookup + GENERATE_COST * p.reference, 1 + p.greedy_check)
            for p in pass_schedule(cfg.eval, tasks)]


def _between(length: int, short: tuple[int, float], long: tuple[int, float]) -> float:
    """A cost at `length`, straight between its values at two prompt lengths."""
    (a, ya), (b, yb) = short, long
    return ya if b == a else ya + (yb - ya) * (length - a) / (b - a)


def _evaluation_probe(cfg: RootConfig, target: Target, head_dir: Path) -> float:
    """Seconds the evaluator will take: the greedy and speculative decoders' prefill and
    per-token times on its first prompt (the latter with the probe's head: an upper bound, module
    docstring) and, where the long-context task makes prompts longer than twice that, on its
    longest too, each prompt priced between the two by its length, times its runs
    (`evaluation_runs`)."""
    if not cfg.pipeline.evaluate:
        return 0.0
    ev = cfg.eval
    encoded = eval_prompts(cfg, target)
    shape = draft_shape(ev, resolve_mode(ev.mode, cfg.head.name))
    drafter, verifier = load_drafter(head_dir, target.model, target.name, [shape])
    decoders = (lambda ids, n: greedy_generate(verifier, ids, n, ()),
                lambda ids, n: speculative_generate(verifier, drafter, ids, n, shape, GREEDY, ()))
    first, longest = encoded[0][1], max((ids for _, ids in encoded), key=len)
    probed = [first] if len(longest) <= 2 * len(first) else [first, longest]
    # rates[d][k]: decoder d's (prefill, per token) at the k-th probed length
    rates = [[_decode_rates(decode, ids, warm=k == 0) for k, ids in enumerate(probed)] for decode in decoders]
    ends = (len(probed[0]), len(probed[-1]))
    total = 0.0
    for (_, ids), runs in zip(encoded, evaluation_runs(cfg, [task for task, _ in encoded])):
        for d, n in enumerate(runs):
            prefill, per_token = (_between(len(ids), (ends[0], rates[d][0][j]), (ends[1], rates[d][-1][j]))
                                  for j in (0, 1))
            total += n * (prefill + ev.max_new_tokens * per_token)
    return total


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _within_share(cfg: RootConfig, started: float, after: str) -> None:
    """Stop when the probes have taken more than `PROBE_SHARE` of the budget: what is left could
    not hold a useful run, and the plan would only say so later (a slow target, a large
    vocabulary)."""
    spent, budget_s = time.perf_counter() - started, cfg.budget_s
    if spent > PROBE_SHARE * budget_s:
        raise UserError(
            f"budget={cfg.budget}: the probes took {_minutes(spent)} by the end of the {after} "
            f"probe, more than {PROBE_SHARE:.0%} of the budget; give a budget of at least "
            f"{_duration(spent / PROBE_SHARE)}, or size the run yourself with data.max_samples "
            "and optim.epochs (the budget is then off)"
        )


def measure(cfg: RootConfig, target: Target) -> tuple[Rates, RegenShape | None]:
    """Run the probes on the run's target and its loaded weights (module docstring), each
    checked against `PROBE_SHARE` of the budget: the rates, and the regeneration engine's shape
    (None: another backend, or nothing was left to answer)."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir) / "plan-probe"
    try:
        regenerated = _regeneration_probe(cfg, target, run_dir)
        _within_share(cfg, started, "regeneration")
        trained = _train_probe(cfg, target, run_dir, train_probe_samples(cfg, regenerated))
        _within_share(cfg, started, "training")
        evaluate_s = _evaluation_probe(cfg, target, run_dir / "head")
        _within_share(cfg, started, "evaluation")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    formats = len(cfg.export.formats or head_kind(cfg.head.name).formats) if cfg.pipeline.export else 0
    head_bytes = trained.pop("head_bytes")
    shape = regenerated["shape"]
    return Rates(
        regenerate_tokens_per_s=regenerated["rate"],
        regenerate_step_cost=None if shape is None else {**asdict(shape.cost), "scale": shape.scale},
        answer_tokens=regenerated["answer_tokens"],
        **trained,
        evaluate_s=evaluate_s,
        export_s=formats * (2 + head_bytes / EXPORT_BYTES_PER_S),
        cached_spans=regenerated["cached"],
        probe_s=time.perf_counter() - started,
    ), shape


def schedule(cfg: RootConfig, epochs: int) -> Schedule:
    """The run's `Schedule` at `epochs`: its cadence planned unless `optim.val_every` was given."""
    o = cfg.optim
    return Schedule(epochs, cfg.data.regenerate.num_samples, 1 - cfg.data.val_fraction, o.val_every,
                    o.save_every)


def _duration(seconds: float) -> str:
    """A `budget=` value at least `seconds` long, in whole minutes."""
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


def unmet_line(cfg: RootConfig, plan: Plan) -> str:
    """The one line a plan that cannot fit its budget stops with: what the smallest plan takes,
    its largest stage, and the settings that would make it fit."""
    stages = {"probes": plan.spent_s, "regenerate": plan.regenerate_s, "capture": plan.capture_s,
              "train": plan.train_s, "evaluate": plan.evaluate_s, "export": plan.export_s}
    largest = max(stages, key=stages.get)
    fixes = [f"budget={_duration(plan.total_s / (1 - MARGIN))}"]
    if largest == "evaluate":
        ev = cfg.eval
        fixes.append(f"fewer eval.max_prompts_per_task (now {ev.max_prompts_per_task}) or "
                     f"eval.max_new_tokens (now {ev.max_new_tokens})")
    fixes.append("data.max_samples and optim.epochs given yourself (the budget is then off)")
    return (
        f"budget={cfg.budget}: even the smallest plan ({plan.conversations} conversations, "
        f"{plan.epochs} epochs) takes {plan.total_s / 60:.1f} min, {largest} alone "
        f"~{_minutes(stages[largest])}; it would fit with " + ", or ".join(fixes)
    )


def plan_file(cfg: RootConfig) -> Path:
    return Path(cfg.run_dir) / PLAN_FILE


def sizes_of(record: dict, answers: int) -> Sizes:
    """The sizes a plan record decided (and its re-check's steps once it has run)."""
    plan, recheck = record["plan"], record.get("recheck")
    return Sizes(
        conversations=plan["conversations"],
        answers=answers,
        epochs=recheck["epochs"] if recheck else plan["epochs"],
        val_every=plan.get("val_every", OptimConfig.DEFAULT_VAL_EVERY),
        max_steps=recheck.get("stopped_at", recheck["steps"]) if recheck else 0,
    )


def plan_run(cfg: RootConfig, target: Target, started: float) -> tuple[Sizes, dict]:
    """Measure, plan and print the plan line: the sizes that fill the budget, and the record
    summary.json keeps (`plan`, `rates`). A plan whose smallest size still does not fit stops
    here, in one line, before the data stage (`unmet_line`). A resumed run (`resume=true`)
    takes the interrupted run's record from its run_dir instead: the data folder and the
    learning-rate schedule must be the ones its checkpoints were made with."""
    answers = cfg.data.regenerate.num_samples
    if cfg.resume and plan_file(cfg).exists():
        record = read_json(plan_file(cfg), "resume=true: the interrupted run's plan")
        sizes = sizes_of(record, answers)
        print(f"plan: {sizes.conversations:,} conversations, {sizes.epochs} epochs, as planned "
              f"before the interruption ({plan_file(cfg)})", flush=True)
        return sizes, record
    rates, shape = measure(cfg, target)
    plan = make_plan(cfg.budget_s, time.perf_counter() - started, rates, schedule(cfg, policy_epochs(cfg)),
                     shape)
    if plan.total_s > plan.budget_s:
        raise UserError(unmet_line(cfg, plan))
    record = {"plan": asdict(plan), "rates": asdict(rates)}
    atomic_write_text(plan_file(cfg), json.dumps(record, indent=2))
    print(plan.line(), flush=True)
    return sizes_of(record, answers), record


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


def recheck(cfg: RootConfig, record: dict, started: float, train_ds, val_ds, samples: int) -> Sizes:
    """After the data stage (`samples` rows built), with `cfg` carrying the plan's sizes: the
    sizes the budget has left room for, measured with the time really spent so far (the steps,
    and epochs when the source ran short), with the training deadline; the record gains what was
    decided (a resumed run's record holds it already)."""
    answers = cfg.data.regenerate.num_samples
    deadline = training_deadline(record, started)
    if "recheck" not in record:
        plan, rates = record["plan"], Rates(**record["rates"])
        left = deadline - time.perf_counter()
        per_epoch = steps_per_epoch(train_ds, cfg.optim, cfg.seed, 1)
        short = samples < 0.9 * plan["conversations"] * plan["answers"]  # the source ran out
        between, last = between_steps_s(rates, sum(val_ds.lengths), cfg.optim.val_every,
                                        cfg.optim.save_every)
        step_s = sum(train_ds.lengths) / max(per_epoch, 1) / rates.train_tokens_per_s + between
        epochs, steps = fit_steps(left, step_s, last, per_epoch, cfg.optim.epochs, short)
        record["recheck"] = {"train_left_s": round(left, 1), "epochs": epochs, "steps": steps,
                             "steps_per_epoch": per_epoch, "short_of_data": short}
        atomic_write_text(plan_file(cfg), json.dumps(record, indent=2))
        if steps < epochs * per_epoch or short:
            print(f"plan: {steps} training steps ({epochs} epochs of {per_epoch}) fit the "
                  f"{left / 60:.1f} min left", flush=True)
    return replace(sizes_of(record, answers), deadline=deadline)
