"""The main job's time budget: how much data and how many epochs fill `budget=20m` on this machine.

A head's acceptance follows its data, and what a budget buys depends on the target and the
machine (bf16 GEMMs or not, a GPU or two cores), so the plan is made from rates measured where it
runs, before the data stage:

1. regeneration: the first conversations the regeneration cache lacks, as many as the engine
   holds at once (`planned_slots`, at least `PROBE_SAMPLES`), are answered by the engine, as the
   data stage would (their answers land in the cache, so the probe costs nothing the run would
   not spend anyway; the cached conversations are free, counted where they are among the
   selected ones, `data_prep.conversations.rows.cached_spans`). The engine times its steps, and
   the plan prices the run's regeneration by replaying the engine's schedule for that many more
   answers like the probe's (`RegenShape`, `data_prep.answers.regen_cost`): one batch runs at
   another rate than a batch and a half, whose last half thins. Another backend (vLLM, servers)
   is priced at the probe's rate;
2. capture and training: a small data folder of those conversations (at least `PROBE_SAMPLES`,
   enough for `PROBE_STEPS` steps) is captured (the capture rate: the target's bare forward plus
   storage, its one-off set-up apart; with one pass, `data_prep.states.onepass`, reading back what the
   regeneration probe kept, which the run's answers will be too, as the probes keep their states
   for the run) and the chosen head trains `PROBE_STEPS` steps on it with the real loop. The
   loop times its steps after the first (whose warm-up a run pays once) apart from what runs
   between them, so the plan has the training rate (online capture included), the seconds a
   validation takes per validation token, and what saving the best head and a checkpoint cost:
   a full-vocabulary Medusa head saves hundreds of MB, and validation grows with the data, so
   both are modelled at the cadence of `optim.val_every` and `optim.save_every` (`train_cost`)
   rather than averaged into the rate of six steps. Unless `optim.val_every` is given, the plan
   also sets it (`planned_val_every`): a long run validates about `VALIDATIONS` times, not every
   50 steps. The probe's validation also decodes the prompts the run will decode
   (`trainer.val_decode`, on by default): a decoded validation costs what its prompts cost,
   whatever the split's size, and is priced per validation. Left to its default, it is planned
   only where the run's decoded validations cost at most `VAL_DECODE_SHARE` of the budget, with
   fewer prompts (down to `MIN_VAL_DECODE_PROMPTS`) where all 8 cost more;
   the probe's barely trained head accepts about nothing, so the price is an upper bound;
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

The parts: `trainer.plan.probes` measures (each probe returns a typed value), `trainer.plan.policy`
is the arithmetic, pure (rates in, a frozen `PlanRecord` out, unit-tested without a pipeline),
`trainer.plan.reuse` keeps the rates for the next run of the same settings on the same machine
(which then plans at once), and this module runs them for the main job and keeps the record in
plan.json.

The planner keeps its word or says so, before the data stage: probes that take more than
`PROBE_SHARE` of the budget stop the job (`probes.within_share`), and so does a plan whose smallest size
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

import json
import time
from dataclasses import replace
from pathlib import Path

from conf.files import atomic_write_text, read_json
from conf.schema import RootConfig
from conf.sizes import Sizes
from data_prep.conversations.ranks import SINGLE, Ranks
from data_prep.target import Target
from heads.kinds import HeadKind
from trainer.loop import steps_per_epoch
from trainer.plan import reuse
from trainer.plan.policy import PlanRecord, Rates, RegenShape, decide_recheck, fitting_plan
from trainer.plan.probes import measure

PLAN_FILE = "plan.json"  # in the run_dir: what a resumed run plans with


def plan_file(cfg: RootConfig) -> Path:
    return Path(cfg.run_dir) / PLAN_FILE


def _keep(cfg: RootConfig, record: PlanRecord) -> PlanRecord:
    atomic_write_text(plan_file(cfg), json.dumps(record.as_dict(), indent=2))
    return record


def plan_run(cfg: RootConfig, target: Target, started: float, kind: HeadKind,
             ranks: Ranks = SINGLE) -> tuple[Sizes, PlanRecord]:
    """Measure, plan and print the plan line: the sizes that fill the budget, and the record
    summary.json keeps. A plan whose smallest size still does not fit stops here, in one line,
    before the data stage (`unmet_line`). A resumed run (`resume=true`) takes the interrupted
    run's record from its run_dir instead: the data folder and the learning-rate schedule must be
    the ones its checkpoints were made with. Under torchrun rank 0 plans, the ranks probe
    together (`probes.measure`), and every rank goes on with rank 0's record."""
    answers = cfg.data.regenerate.num_samples
    if cfg.resume and plan_file(cfg).exists():
        where = plan_file(cfg)
        record = PlanRecord.from_dict(read_json(where, "resume=true: the interrupted run's plan"), str(where))
        sizes = record.sizes(answers)
        if ranks.main:
            print(f"plan: {sizes.conversations:,} conversations, {sizes.epochs} epochs, as planned "
                  f"before the interruption ({where})", flush=True)
        return sizes, record
    rates, shape = probed_rates(cfg, target, started, kind, ranks)

    def plan() -> PlanRecord:
        made = fitting_plan(cfg, time.perf_counter() - started, rates, shape)
        print(made.line(), flush=True)
        return _keep(cfg, PlanRecord(made, rates))

    record = ranks.main_does(plan)
    return record.sizes(answers), record


def probed_rates(cfg: RootConfig, target: Target, started: float, kind: HeadKind,
                 ranks: Ranks = SINGLE) -> tuple[Rates, RegenShape | None]:
    """The probes' rates for `ranks` processes, measured by them together: an earlier run's on
    this machine, target, settings and world (`reuse`), or measured now and kept for the next
    run. Several ranks regenerate with as many engines, priced at the probe's rate: the engine's
    replayed schedule (`shape`) is one engine's."""
    found = ranks.main_does(lambda: reuse.kept(cfg, target, ranks.world))
    if found is not None:
        rates, shape, path = found
        if ranks.main:
            print(f"plan: the probes' rates of an earlier run on this machine, target and settings, reused "
                  f"(delete {path} to measure them again)", flush=True)
    else:
        rates, shape = measure(cfg, target, started, kind, ranks)
        if ranks.main:
            reuse.keep(cfg, target, ranks.world, rates, shape)
    return rates, shape if ranks.world == 1 else None


def note_stop(cfg: RootConfig, record: PlanRecord, steps: int) -> PlanRecord:
    """Training ended at `steps`: before the re-check's count when its deadline cut it short. A
    resumed run then ends there too (plan.json), instead of training what the deadline cut."""
    if steps >= record.recheck.steps:
        return record
    return _keep(cfg, replace(record, recheck=replace(record.recheck, stopped_at=steps)))


def recheck(cfg: RootConfig, record: PlanRecord, started: float, train_ds, val_ds,
            samples: int, ranks: Ranks = SINGLE) -> tuple[Sizes, PlanRecord]:
    """After the data stage (`samples` rows built), with `cfg` carrying the plan's sizes: the
    sizes the budget has left room for, measured with the time really spent so far
    (`decide_recheck`), with the training deadline, and the record with what was decided (a
    resumed run's record holds it already). Decided by rank 0 on its clock for every rank: the
    ranks must train the same steps, and the deadline is read on rank 0 alone
    (`trainer.deadline`)."""
    deadline = record.deadline(started)

    def decide() -> PlanRecord:
        per_epoch = steps_per_epoch(train_ds, cfg.optim, cfg.seed, ranks.world)
        left = deadline - time.perf_counter()
        decided = decide_recheck(record.plan, record.rates, left, per_epoch, samples, sum(train_ds.lengths),
                                 sum(val_ds.lengths), cfg.optim)
        if decided.steps < decided.epochs * per_epoch or decided.short_of_data:
            print(f"plan: {decided.steps} training steps ({decided.epochs} epochs of {per_epoch}) fit the "
                  f"{decided.train_left_s / 60:.1f} min left", flush=True)
        return _keep(cfg, replace(record, recheck=decided))

    if record.recheck is None:
        record = ranks.main_does(decide)
    return replace(record.sizes(cfg.data.regenerate.num_samples), deadline=deadline), record
