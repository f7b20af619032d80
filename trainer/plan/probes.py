"""The probes: what this machine and target measure, each stage timed as the run will run it.

`measure` runs them in order on the run's loaded target (`trainer.plan`'s docstring says what each
times and why), each returning a typed value (`RegenProbe`, `TrainProbe`, the evaluation's
seconds) that `measure` folds into the plan's `Rates`. It stops the job as soon as the probes
have spent more than `PROBE_SHARE` of the budget (`within_share`), or as soon as what they have
measured shows that the smallest plan cannot fit (each probe's stages priced, the stages not yet
probed free: `fitting_plan` on a lower bound), rather than after every probe has run.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from conf.errors import UserError
from conf.schema import RootConfig, derive
from data_prep.answers.regen_cost import StepCost
from data_prep.answers.regen_engine import default_workers, planned_slots
from data_prep.answers.regenerate import read_cache
from data_prep.conversations.ranks import SINGLE, Ranks
from data_prep.conversations.rows import Spans, cached_spans, uncached_prefix
from data_prep.folders.folder import DataFolder
from data_prep.folders.keys import regen_cache_file
from data_prep.folders.store import CapturedDataset, online_capture
from data_prep.linears import DecodeLinears
from data_prep.prepare import capture_spec, prepare
from data_prep.states.onepass import one_pass
from data_prep.target import Target
from heads.export.write import default_formats
from heads.kinds import HeadKind
from trainer.decoding import GREEDY, greedy_generate, speculative_generate
from trainer.distributed import build_accelerator
from trainer.evaluate.run import draft_shape, eval_prompts, load_drafter, resolve_mode
from trainer.kinds import build_trainee
from trainer.loop import fit, steps_per_epoch
from trainer.plan.policy import (
    MIN_CONVERSATIONS,
    Rates,
    RegenShape,
    budget_value,
    evaluation_runs,
    fitting_plan,
    minutes,
)
from trainer.val_decode import decoder_or_off

PROBE_SAMPLES = MIN_CONVERSATIONS  # conversations in the capture-and-train probe folder, at least
PROBE_STEPS = 6  # training steps on it, timed after the first (`Throughput.steady_tokens_per_s`)
PROBE_TOKENS = 16  # tokens the evaluator's decoder writes to time one token
PROBE_SHARE = 0.5  # of the budget, the most the probes may take before the plan is made
EXPORT_BYTES_PER_S = 200e6  # an export writes the head once per format


@dataclass(frozen=True)
class RegenProbe:
    """What the regeneration probe measured (the defaults: regeneration off)."""

    tokens_per_s: float = math.inf  # new tokens; inf: off, or nothing left to answer
    answer_tokens: float = 0.0  # new tokens per new conversation
    row_tokens: float | None = None  # tokens per conversation and answer in its folder
    cached: Spans = ()  # the selected conversations the cache holds now (free for the run)
    conversations: int = 0  # how many it probed
    shape: RegenShape | None = None  # the engine's, for any number of conversations


@dataclass(frozen=True)
class TrainProbe:
    """What the capture-and-train probe measured (`Rates` names each)."""

    capture_tokens_per_s: float
    train_tokens_per_s: float
    tokens_per_step: float
    validate_s_per_token: float
    save_best_s: float
    checkpoint_s: float
    row_tokens: float
    head_bytes: int  # the trained parameters at 2 bytes each: what an export writes per format
    val_decode_s: float = 0.0  # one decoded validation of the run's prompts (0.0: the run decodes none)

    @classmethod
    def unmeasured(cls, row_tokens: float | None) -> TrainProbe:
        """Capture and training priced free: the lower bound before the training probe runs."""
        return cls(math.inf, math.inf, math.inf, 0.0, 0.0, 0.0, row_tokens or 0.0, 0)


def probe_config(cfg: RootConfig, samples: int, hidden_states: str, run_dir: Path,
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


def regeneration_probe(cfg: RootConfig, target: Target, run_dir: Path, kind: HeadKind,
                       ranks: Ranks = SINGLE) -> RegenProbe:
    """The first conversations regenerated into the cache, up to as many new ones as the engine
    holds at once (`planned_slots`), at least `PROBE_SAMPLES` (their ids into a throwaway online
    folder): a warm cache's answers are passed over, not taken for the probe (all cached, the
    rate stays unknown and regeneration is priced free). The ranks answer it together, as they
    will the run's (`data_prep.conversations.ranks`: the rate is the world's), each its share: one engine's
    worth in all, not one each, which on CPU ranks sharing the cores would double the probe's
    time (the rate of engines half full is, if anything, low). The engine's fitted step cost
    comes with the folder's stats (`PrepStats.regenerate_step_cost`), and becomes the
    `RegenShape`."""
    d = cfg.data
    if not d.regenerate.enabled:
        return RegenProbe()
    tpl = target.chat_template
    cache = regen_cache_file(cfg, target.identity, tpl)
    r = d.regenerate
    workers = r.workers or default_workers(target.model, r.batch_size)
    kept = len(capture_spec(cfg, kind, target.identity["num_hidden_layers"]).layers) if one_pass(cfg) else 0
    slots = planned_slots(target.model, r.batch_size, workers, d.max_length, kept)  # few at long contexts
    before = ranks.main_does(lambda: read_cache(cache))  # before any rank writes to it
    size = uncached_prefix(cached_spans(cfg, tpl, before), max(PROBE_SAMPLES, slots // r.num_samples))
    # The first long wait of a run, and often all its regeneration (a small budget's plan reuses
    # the probe's answers): its bar draws as the run's would.
    data = prepare(probe_config(cfg, size, "online", run_dir, cfg.logging.progress), target=target,
                   ranks=ranks, keep_states=one_pass(cfg), kind=kind)
    answered = read_cache(cache)
    shape = None
    if data.stats.regenerate_step_cost is not None:
        cost = StepCost(**data.stats.regenerate_step_cost)
        shape = RegenShape(cost, answer_rounds(answered), len(answered), slots, workers)
        replayed = shape.replay(answer_rounds({u: t for u, t in answered.items() if u not in before}))
        shape = replace(shape, scale=data.stats.regenerate_seconds / replayed if replayed else 1.0)
    made = data.stats.regenerated_tokens  # 0: the source held nothing more to answer
    probed = RegenProbe(
        tokens_per_s=data.regenerate_tokens_per_s if made else math.inf,
        answer_tokens=made / max(1, len(answered) - len(before)),
        row_tokens=conversation_tokens(cfg, data, size),
        cached=cached_spans(cfg, tpl, answered),  # the probe's answers included: the run reuses them
        conversations=size,
        shape=shape,
    )
    ranks.barrier()  # every rank has read the folder
    if ranks.main:
        shutil.rmtree(data.path, ignore_errors=True)
    return probed


def train_probe(cfg: RootConfig, target: Target, run_dir: Path, samples: int, kind: HeadKind,
                ranks: Ranks = SINGLE) -> TrainProbe:
    """A folder of the first `samples` conversations captured (capture tokens/s) and up to
    `PROBE_STEPS` training steps of the chosen head on it, the last validated (decoding the
    prompts the run's validations will decode) and saved. The head it trained stays in
    run_dir/head for the evaluation probe. Several `ranks` capture and train it together as they
    will the run (each its share of the shards, then DDP or ZeRO on its own batches: the rates
    are the world's)."""
    probe = probe_config(cfg, samples, cfg.data.hidden_states, run_dir)
    data = prepare(probe, target=target, ranks=ranks, keep_states=one_pass(cfg), kind=kind)
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
    wanted = cfg.val_decode_prompts  # the run's decoded validation, or its default's, to be priced
    decoding = derive(probe, {"optim.val_decode_prompts": wanted})
    # (a default the head cannot decode is off here as in the run, which says so)
    _, val_decode, _ = decoder_or_off(cfg, decoding, trainee, (target.model, target.tokenizer), val_ds)
    with contextlib.redirect_stdout(io.StringIO()):  # a few steps' validation lines are not the run's
        result = fit(probe, acc, trainee, train_ds, val_ds, run_dir, capture, val_decode)
    del acc, trainee
    gc.collect()
    shutil.rmtree(data.path, ignore_errors=True)
    between = result.between_steps
    return TrainProbe(
        capture_tokens_per_s=math.inf if data.capture_tokens_per_s is None else data.capture_tokens_per_s,
        train_tokens_per_s=result.step_tokens_per_s,
        tokens_per_step=result.tokens_per_step,
        validate_s_per_token=between.per_validation() / max(sum(val_ds.lengths), 1),
        save_best_s=between.per_best_save(),
        checkpoint_s=between.per_checkpoint(),
        row_tokens=conversation_tokens(cfg, data, samples),
        head_bytes=head_bytes,
        # a probe split of fewer prompts than the run decodes, priced up to the run's
        val_decode_s=0.0 if val_decode is None else
        between.per_decoded_validation() * wanted / len(val_decode.prompts),
    )


def train_probe_samples(cfg: RootConfig, regenerated: RegenProbe) -> int:
    """Conversations enough for `PROBE_STEPS` steps (by the regeneration probe's tokens per
    conversation), at least `PROBE_SAMPLES`, at most those the regeneration probe answered (so
    the training probe regenerates nothing more)."""
    o = cfg.optim
    if not regenerated.row_tokens:
        return PROBE_SAMPLES
    want = math.ceil((PROBE_STEPS + 1) * o.batch_tokens * o.grad_accum
                     / (regenerated.row_tokens * (1 - cfg.data.val_fraction)))
    return max(PROBE_SAMPLES, min(want, regenerated.conversations))


def _decode_rates(decode, ids: torch.Tensor, warm: bool) -> tuple[float, float]:
    """(prefill seconds, seconds per further token) of `decode(ids, max_new_tokens)`, from its
    own stats, after a short warm-up where `warm` (the first call pays for allocations)."""
    if warm:
        decode(ids, 4)
    stats = decode(ids, PROBE_TOKENS).stats
    return stats.prefill_s, (stats.total_s - stats.prefill_s) / max(stats.new_tokens - 1, 1)


def _between(length: int, short: tuple[int, float], long: tuple[int, float]) -> float:
    """A cost at `length`, straight between its values at two prompt lengths."""
    (a, ya), (b, yb) = short, long
    return ya if b == a else ya + (yb - ya) * (length - a) / (b - a)


def evaluation_probe(cfg: RootConfig, target: Target, head_dir: Path) -> float:
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
    # rates[d][k]: decoder d's (prefill, per token) at the k-th probed length, on the linears the
    # evaluator decodes with
    with DecodeLinears(verifier):
        rates = [[_decode_rates(decode, ids, warm=k == 0) for k, ids in enumerate(probed)]
                 for decode in decoders]
    ends = (len(probed[0]), len(probed[-1]))
    total = 0.0
    for (_, ids), runs in zip(encoded, evaluation_runs(cfg, [task for task, _ in encoded])):
        for d, n in enumerate(runs):
            prefill, per_token = (_between(len(ids), (ends[0], rates[d][0][j]), (ends[1], rates[d][-1][j]))
                                  for j in (0, 1))
            total += n * (prefill + ev.max_new_tokens * per_token)
    return total


def within_share(cfg: RootConfig, started: float, after: str) -> None:
    """Stop when the probes have taken more than `PROBE_SHARE` of the budget: what is left could
    not hold a useful run, and the plan would only say so later (a slow target, a large
    vocabulary)."""
    spent, budget_s = time.perf_counter() - started, cfg.budget_s
    if spent > PROBE_SHARE * budget_s:
        raise UserError(
            f"budget={cfg.budget}: the probes took {minutes(spent)} by the end of the {after} "
            f"probe, more than {PROBE_SHARE:.0%} of the budget; give a budget of at least "
            f"{budget_value(spent / PROBE_SHARE)}, or size the run yourself with data.max_samples "
            "and optim.epochs (the budget is then off)"
        )


def measure(cfg: RootConfig, target: Target, run_started: float, kind: HeadKind,
            ranks: Ranks = SINGLE) -> tuple[Rates, RegenShape | None]:
    """Run the probes on the run's target and its loaded weights (`trainer.plan`'s docstring), each
    checked against `PROBE_SHARE` of the budget and, with what is measured so far, against the
    smallest plan (`run_started`: the run's start, which the plan counts from): the rates, and the
    regeneration engine's shape (None: another backend, or nothing was left to answer).

    Under torchrun (`ranks`) the ranks regenerate, capture and train the probes together, as
    they will the run, so every rate is the world's (their contention for the machine included);
    rank 0 evaluates alone, as after the run; the values are rank 0's on every rank."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir) / "plan-probe"

    def checked(after: str, regenerated: RegenProbe, trained: TrainProbe, evaluate_s: float = 0.0) -> None:
        within_share(cfg, started, after)
        rates = rates_of(cfg, kind, regenerated, trained, evaluate_s, started)
        fitting_plan(cfg, time.perf_counter() - run_started, rates, regenerated.shape, bound=True)

    def evaluate(trained: TrainProbe) -> float:
        checked("training", regenerated, trained)
        evaluate_s = evaluation_probe(cfg, target, run_dir / "head")
        within_share(cfg, started, "evaluation")
        return evaluate_s

    try:
        regenerated = ranks.from_main(regeneration_probe(cfg, target, run_dir, kind, ranks))
        ranks.main_does(lambda: checked("regeneration", regenerated,
                                        TrainProbe.unmeasured(regenerated.row_tokens)))
        trained = train_probe(cfg, target, run_dir, train_probe_samples(cfg, regenerated), kind, ranks)
        trained = ranks.from_main(trained)  # rank 0's clock, as for every rate
        evaluate_s = ranks.main_does(lambda: evaluate(trained))
    finally:
        if ranks.main:  # the others are past their last read of it, or stopped with rank 0
            shutil.rmtree(run_dir, ignore_errors=True)
    return rates_of(cfg, kind, regenerated, trained, evaluate_s, started), regenerated.shape


def rates_of(cfg: RootConfig, kind: HeadKind, regenerated: RegenProbe, trained: TrainProbe,
             evaluate_s: float, started: float) -> Rates:
    """The plan's `Rates` from the probes' values (`started`: when the probes began)."""
    written = cfg.export.formats or default_formats(kind, vars(cfg.head))
    formats = len(written) if cfg.pipeline.export else 0
    shape = regenerated.shape
    return Rates(
        regenerate_tokens_per_s=regenerated.tokens_per_s,
        regenerate_step_cost=None if shape is None else {**asdict(shape.cost), "scale": shape.scale},
        answer_tokens=regenerated.answer_tokens,
        capture_tokens_per_s=trained.capture_tokens_per_s,
        train_tokens_per_s=trained.train_tokens_per_s,
        tokens_per_step=trained.tokens_per_step,
        validate_s_per_token=trained.validate_s_per_token,
        save_best_s=trained.save_best_s,
        checkpoint_s=trained.checkpoint_s,
        row_tokens=trained.row_tokens,
        evaluate_s=evaluate_s,
        export_s=formats * (2 + trained.head_bytes / EXPORT_BYTES_PER_S),
        val_decode_s=trained.val_decode_s,
        cached_spans=regenerated.cached,
        probe_s=time.perf_counter() - started,
    )
