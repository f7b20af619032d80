"""The plan's arithmetic, pure: measured rates in, the sizes that fill a budget out.

Nothing here runs a model or reads a file, so every rule of the time budget (`trainer.plan`) is
unit-tested on made-up rates (tests/unit/trainer/test_plan.py): what the budget buys
(`make_plan`), what validation and saves cost at their cadence (`train_cost`), what the re-check
after the data stage trims or grows (`fit_steps`, `decide_recheck`), and the one line a budget
that cannot fit stops with (`unmet_line`). The plan and what it was made from travel as one
frozen `PlanRecord`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace

from conf.errors import UserError
from conf.schema import OptimConfig, RootConfig
from conf.sizes import Sizes
from data_prep.answers.regen_cost import StepCost, generate_seconds
from data_prep.conversations.rows import Spans, cached_before
from trainer.evaluate.run import pass_schedule, resolve_mode
from trainer.val_decode import MIN_VAL_DECODE_PROMPTS, VAL_DECODE_SHARE

MARGIN = 0.06  # of the budget, kept back for the export and the noise in the measured rates
MIN_CONVERSATIONS = 48  # the smallest plan: the training probe's folder (`probes.PROBE_SAMPLES`)
MAX_EPOCHS = 4  # the most epochs the re-check grows to when the source holds too few conversations
VALIDATIONS = 10  # a planned run validates about this many times at most (and at its last step)
GENERATE_COST = 1.5  # transformers' `generate` per token, in greedy decoder tokens


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
    # one decoded validation (`trainer.val_decode`) of the run's prompts, with the probe's barely
    # trained head (an upper bound); 0.0: none priced
    val_decode_s: float = 0.0


@dataclass(frozen=True)
class RegenShape:
    """What the regeneration probe answered, as the engine's seconds for any number of
    conversations (`data_prep.answers.regen_cost`): its fitted step cost, and per round (a
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
    # decoded validation over the run (in `train_s` where `decodes`): what the default's share
    # of the budget is judged by (`fitting_plan`), and the prompts each validation decodes
    val_decode_s: float = 0.0
    decode_prompts: int = 0

    @property
    def decodes(self) -> bool:
        return self.decode_prompts > 0

    @property
    def total_s(self) -> float:
        return (self.spent_s + self.regenerate_s + self.capture_s + self.train_s + self.evaluate_s
                + self.export_s)

    def line(self) -> str:
        m = minutes
        return (
            f"plan: {self.conversations:,} conversations x {self.answers} answer"
            f"{'s' if self.answers > 1 else ''}, {self.epochs} epoch{'s' if self.epochs > 1 else ''}: "
            f"probes {m(self.spent_s)}, regenerate ~{m(self.regenerate_s)}, capture ~{m(self.capture_s)}, "
            f"train ~{m(self.train_s)}{self._decoding()}, evaluate ~{m(self.evaluate_s)}, "
            f"export ~{m(self.export_s)} "
            f"= {self.total_s / 60:.1f} of {self.budget_s / 60:.0f} min"
        )

    def _decoding(self) -> str:
        """The decoded validations' share of `train_s`, where the run decodes."""
        if not self.decodes:
            return ""
        return f" (decoded validation of {self.decode_prompts} prompts ~{minutes(self.val_decode_s)})"


def policy_epochs(cfg: RootConfig) -> int:
    """The passes over the data the budget buys first (then more conversations): the head's own
    default, which the policy measurements chose (module docstring)."""
    return cfg.head.DEFAULT_EPOCHS


@dataclass(frozen=True)
class Schedule:
    """How the data is trained, besides its size: the policy's epochs and answers per prompt, the
    share of the rows that trains (the rest validates), `optim.val_every` (None: planned,
    `planned_val_every`), `optim.save_every`, and whether each validation decodes
    (`trainer.val_decode`, priced at `Rates.val_decode_s`)."""

    epochs: int
    answers: int
    train_share: float
    val_every: int | None
    save_every: int
    decodes: bool = False


def schedule(cfg: RootConfig, epochs: int) -> Schedule:
    """The run's `Schedule` at `epochs`: its cadence planned unless `optim.val_every` was given."""
    o = cfg.optim
    return Schedule(epochs, cfg.data.regenerate.num_samples, 1 - cfg.data.val_fraction, o.val_every,
                    o.save_every, cfg.val_decode_prompts > 0)


def planned_val_every(steps: float) -> int:
    """Every `DEFAULT_VAL_EVERY` steps, or less often so that a long run validates about
    `VALIDATIONS` times: the validation split grows with the data, so at a fixed cadence its
    cost grows with the square of the data (a third of a 40-minute run's training at 50 steps
    apart on the embedded default), while the best head is nearly always one of the last."""
    return max(OptimConfig.DEFAULT_VAL_EVERY, math.ceil(steps / VALIDATIONS))


def between_steps_s(rates: Rates, val_tokens: float, val_every: int, save_every: int,
                    decodes: bool = False) -> tuple[float, float]:
    """(seconds per training step, seconds once at the end) spent validating `val_tokens` (and
    decoding, where each validation `decodes`) and saving the best head every `val_every` steps
    and checkpointing every `save_every`: the last step always does both."""
    validation = val_tokens * rates.validate_s_per_token + rates.save_best_s
    validation += rates.val_decode_s if decodes else 0.0
    return validation / val_every + rates.checkpoint_s / save_every, validation + rates.checkpoint_s


def training_steps(rates: Rates, rows: float, schedule: Schedule) -> tuple[float, int]:
    """(optimizer steps, the validation cadence) of a run on `rows` data rows."""
    steps = schedule.epochs * rows * rates.row_tokens * schedule.train_share / rates.tokens_per_step
    return steps, schedule.val_every or planned_val_every(steps)


def train_cost(rates: Rates, rows: float, schedule: Schedule) -> tuple[float, int]:
    """(the training stage's seconds, the validation cadence) for `rows` data rows: the steps at
    the measured rate, and validations and saves at their cadence (validation grows with the
    data too, so the seconds grow faster than `rows`)."""
    tokens = rows * rates.row_tokens
    steps, val_every = training_steps(rates, rows, schedule)
    per_step, last = between_steps_s(rates, tokens * (1 - schedule.train_share), val_every,
                                     schedule.save_every, schedule.decodes)
    return steps * rates.tokens_per_step / rates.train_tokens_per_s + steps * per_step + last, val_every


def val_decode_cost(rates: Rates, rows: float, schedule: Schedule) -> float:
    """Seconds decoded validation takes over a run on `rows` data rows, whether or not the
    schedule decodes: a validation every `val_every` steps and one at the last."""
    steps, val_every = training_steps(rates, rows, schedule)
    return (math.floor(steps / val_every) + 1) * rates.val_decode_s


def make_plan(budget_s: float, spent_s: float, rates: Rates, schedule: Schedule,
              shape: RegenShape | None = None, decode_prompts: int = 0) -> Plan:
    """The most conversations whose stages fit the budget less `MARGIN`, the probes, evaluation
    and export. Conversations in `rates.cached_spans` cost no regeneration; the rest
    cost what `shape` says the engine takes for them, else (another backend) the probe's rate.
    `decode_prompts`: what each decoded validation runs (`rates.val_decode_s` its price), where
    the schedule decodes."""
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
    decode_s = val_decode_cost(rates, n * answers, schedule)
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
        val_decode_s=decode_s,
        decode_prompts=decode_prompts if schedule.decodes else 0,
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


def evaluation_runs(cfg: RootConfig, tasks: list[str]) -> list[tuple[float, float]]:
    """(greedy-decoder runs, speculative-decoder runs) the evaluator makes of each prompt of
    `tasks`, from its own pass schedule (`trainer.evaluate.run.pass_schedule`): each prompt's
    greedy baseline and speculative run, and the passes the schedule adds (prompt lookup, the
    `generate` reference at `GENERATE_COST`, a sampled run's greedy check, a chain's settings
    sweep). Each run prefills the prompt and writes up to `eval.max_new_tokens`."""
    chain = resolve_mode(cfg.eval.mode, cfg.head.name) == "chain"
    return [(1 + p.lookup + GENERATE_COST * p.reference, 1 + p.greedy_check + p.settings)
            for p in pass_schedule(cfg.eval, tasks, chain)]


def minutes(seconds: float) -> str:
    """`seconds` as the plan's lines show them: whole minutes from 90 s, else seconds."""
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def budget_value(seconds: float) -> str:
    """A `budget=` value at least `seconds` long, in whole minutes."""
    whole = math.ceil(seconds / 60)
    return f"{whole // 60}h{whole % 60:02d}m" if whole >= 60 else f"{whole}m"


def fitting_plan(cfg: RootConfig, spent_s: float, rates: Rates, shape: RegenShape | None,
                 bound: bool = False) -> Plan:
    """The plan for `cfg`'s budget, or the one line (`unmet_line`) that its smallest size does
    not fit. Decoded validation left to its default (`optim.val_decode_prompts=null`) is planned
    only where the run `affords` it: with fewer prompts where all of the default's cost more,
    down to `MIN_VAL_DECODE_PROMPTS`, else none (`Plan.decode_prompts`), never refusing a budget
    that fits without it. `bound`: `rates` price the stages not yet probed free, so the plan is a
    lower bound and a smallest plan over the budget already means no plan fits."""
    planned, wanted = schedule(cfg, policy_epochs(cfg)), cfg.val_decode_prompts
    plan = make_plan(cfg.budget_s, spent_s, rates, planned, shape, wanted)
    if cfg.optim.val_decode_prompts is None and not affords(plan):
        plan = default_decoding_plan(cfg, spent_s, rates, shape, planned, plan)
    if plan.total_s > plan.budget_s:
        raise UserError(unmet_line(cfg, plan, bound))
    return plan


def affords(plan: Plan) -> bool:
    """Whether `plan` takes the default decoded validation it prices: its validations cost at
    most `VAL_DECODE_SHARE` of the budget and the plan fits the budget with them (the smallest
    plan may not: decoding goes before the run is refused)."""
    return plan.val_decode_s <= VAL_DECODE_SHARE * plan.budget_s and plan.total_s <= plan.budget_s


def default_decoding_plan(cfg: RootConfig, spent_s: float, rates: Rates, shape: RegenShape | None,
                          planned: Schedule, dear: Plan) -> Plan:
    """The plan for the default decoded validation that `dear` (all of its prompts) cannot
    afford: the most prompts, priced each at an equal part of `rates.val_decode_s`, that the run
    `affords` (the cadence stays about `VALIDATIONS`, so few are tried), or, under
    `MIN_VAL_DECODE_PROMPTS`, a plan without it that still says what it would have cost."""
    wanted = cfg.val_decode_prompts
    share = VAL_DECODE_SHARE * dear.budget_s
    fits = math.floor(wanted * share / dear.val_decode_s) if dear.val_decode_s > share else wanted
    for n in range(min(fits, wanted - 1), MIN_VAL_DECODE_PROMPTS - 1, -1):
        fewer = replace(rates, val_decode_s=rates.val_decode_s * n / wanted)
        plan = make_plan(cfg.budget_s, spent_s, fewer, planned, shape, n)
        if affords(plan):
            return plan
    return replace(make_plan(cfg.budget_s, spent_s, rates, replace(planned, decodes=False), shape),
                   val_decode_s=dear.val_decode_s)


def unmet_line(cfg: RootConfig, plan: Plan, bound: bool = False) -> str:
    """The one line a plan that cannot fit its budget stops with: what the smallest plan takes
    (`bound`: at least, the stages not yet probed left out), its largest stage, and the settings
    that would make it fit."""
    stages = {"probes": plan.spent_s, "regenerate": plan.regenerate_s, "capture": plan.capture_s,
              "train": plan.train_s, "evaluate": plan.evaluate_s, "export": plan.export_s}
    largest = max(stages, key=stages.get)
    fixes = [f"budget={budget_value(plan.total_s / (1 - MARGIN))}"]
    if largest == "evaluate":
        ev = cfg.eval
        fixes.append(f"fewer eval.max_prompts_per_task (now {ev.max_prompts_per_task}) or "
                     f"eval.max_new_tokens (now {ev.max_new_tokens})")
    fixes.append("data.max_samples and optim.epochs given yourself (the budget is then off)")
    takes = f"takes {'at least ' if bound else ''}{plan.total_s / 60:.1f} min"
    return (
        f"budget={cfg.budget}: even the smallest plan ({plan.conversations} conversations, "
        f"{plan.epochs} epochs) {takes}, {largest} alone "
        f"~{minutes(stages[largest])}; it would fit with " + ", or ".join(fixes)
    )


@dataclass(frozen=True)
class Recheck:
    """What the re-check after the data stage decided (`decide_recheck`)."""

    train_left_s: float  # seconds left for training once the data was built
    epochs: int
    steps: int
    steps_per_epoch: int
    short_of_data: bool  # the source held under 90% of the planned conversations
    stopped_at: int | None = None  # the step training ended at, where its deadline cut it short


def decide_recheck(plan: Plan, rates: Rates, left_s: float, per_epoch: int, samples: int,
                   train_tokens: int, val_tokens: int, optim: OptimConfig) -> Recheck:
    """The steps (and epochs, when the source ran short) that fit the `left_s` seconds left for
    training, at the measured rate over the data built: `samples` rows, `per_epoch` steps an
    epoch, `train_tokens` and `val_tokens` in its splits."""
    short = samples < 0.9 * plan.conversations * plan.answers
    between, last = between_steps_s(rates, val_tokens, optim.val_every, optim.save_every,
                                    bool(optim.val_decode_prompts))
    step_s = train_tokens / max(per_epoch, 1) / rates.train_tokens_per_s + between
    epochs, steps = fit_steps(left_s, step_s, last, per_epoch, optim.epochs, short)
    return Recheck(round(left_s, 1), epochs, steps, per_epoch, short)


@dataclass(frozen=True)
class PlanRecord:
    """The plan and what it was made from: summary.json's `budget` and the run_dir's plan.json,
    which a resumed run follows instead of planning again. Frozen: a stage that learns more (the
    re-check, where training stopped) makes a new record (`dataclasses.replace`)."""

    plan: Plan
    rates: Rates
    recheck: Recheck | None = None

    def sizes(self, answers: int) -> Sizes:
        """The sizes it decided: the plan's, and the re-check's steps once it has run."""
        plan, recheck = self.plan, self.recheck
        return Sizes(
            conversations=plan.conversations,
            answers=answers,
            epochs=recheck.epochs if recheck else plan.epochs,
            val_every=plan.val_every,
            max_steps=(recheck.stopped_at or recheck.steps) if recheck else 0,
        )

    def deadline(self, started: float) -> float:
        """The `time.perf_counter()` by which training must end for evaluation and export to
        finish within the budget (less `MARGIN`), for a run that started at `started`: the loop's
        last guard when training runs slower than the probe measured (a busier machine, longer
        rows)."""
        plan = self.plan
        return started + plan.budget_s * (1 - MARGIN) - plan.evaluate_s - plan.export_s

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict, where: str) -> PlanRecord:
        """The record `as_dict` wrote, read back; one that this version cannot read is refused
        in one line naming `where` (a plan.json from another version)."""
        try:
            rates = dict(record["rates"])
            rates["cached_spans"] = tuple(tuple(span) for span in rates["cached_spans"])
            recheck = record.get("recheck")
            return cls(Plan(**record["plan"]), Rates(**rates), Recheck(**recheck) if recheck else None)
        except (KeyError, TypeError) as err:
            raise UserError(f"{where}: not a plan this version of draftsmith reads ({err}); "
                            "start the run again without resume=true") from None
