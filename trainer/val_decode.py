"""Decoded validation: the built-in decoder runs a few validation prompts with the head in
training, so that the kept head can be the one that decodes best (`optim.select_by`).

The simulated acceptance length is teacher-forced: each draft step reads the true prefix, not the
head's own earlier guesses. On the README's main job it said 1.85 where the evaluation decoded
1.51 (issue #60), and it can go on rising while real acceptance has peaked and falls (heads
trained past their best). This runs the evaluator's own decoder (`trainer.decoding`), shape and
counting, greedy, on prompts of the validation split: what the data's answers continue from,
never the evaluation's tasks.

On by default (`optim.val_decode_prompts=null`: 8 prompts of `optim.val_decode_tokens`=32
tokens each), and the kept head is the best decoded one (`optim.select_by=auto`), wherever the
run can decode and, under a time budget, where the plan prices it under `VAL_DECODE_SHARE` of
the budget, with as few as `MIN_VAL_DECODE_PROMPTS` prompts where all of them would cost more
(`trainer.plan.policy.fitting_plan`); else it is off with one line: the config rules
it out (`RootConfig.val_decode_off`: ZeRO-3, no validation split, a split or served target) or
the plan does (`resolve_decoding`), the target's attention is one the decoders cannot mask
(`trainer.train.check_decoders`), or the head cannot draft the evaluator's shape
(`decoder_or_off`). A number the user gives is never turned off: it is refused where it
cannot run. Cheap by size, not by batching: the decoder is batch 1 (its static KV caches and the
drafters' state are one request's), so the prompts run one after the other, few and short.
Rank 0 decodes; summary.json names the `best_step` and its `kept_validation` (simulated and
decoded τ), and checkpoints carry the best so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conf.errors import UserError
from conf.schema import RootConfig, derive
from data_prep.target import eos_token_ids
from trainer.decoding import GREEDY, MedusaDrafter, pooled_per_position, speculative_generate
from trainer.decoding.drafters import Shape
from trainer.evaluate.run import draft_shape, resolve_mode
from trainer.selection import chosen_by

# The most of a budgeted run the default decoded validation may take, as the plan prices it. The
# plan prices it with the probe's barely trained head, which accepts about nothing, so every token
# costs a verify step: an upper bound; a head at τ 1.5 decodes the same tokens in about 2/3 of
# the steps, so 15% priced is about 10% spent. Estimated on the README's main job (20 min, 2
# cores: ~38 ms a step, ~11 validations of 8 x 32 tokens) it prices ~9%.
VAL_DECODE_SHARE = 0.15
# The fewest prompts the default decodes where all of its prompts would cost over the share
# (`trainer.plan.policy.default_decoding_plan`): 4 x 32 tokens still tell a head at τ 1.3 from
# one at 1.5 (~100 drafts each), fewer are mostly noise. The README's main job prices its 8 at
# 254 s of 180 (2026-12-07): 5 fit.
MIN_VAL_DECODE_PROMPTS = 4


def prompt_ids(item: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ids of a sample before its first answer token: what the target continued."""
    first = int(item["loss_mask"].int().argmax())
    return item["input_ids"][:first]


def spread(count: int, n: int) -> list[int]:
    """`n` indices evenly spread over range(count) (all when n >= count): the validation split
    is sorted by length, so its first ones would all be the shortest samples."""
    if n >= count:
        return list(range(count))
    return [round(i * (count - 1) / max(n - 1, 1)) for i in range(n)]


def pooled_acceptance_length(accepted: int, drafts: int) -> float:
    """1 + accepted / drafts over all prompts (a ratio of sums, as the evaluator and vLLM count)."""
    return 1.0 + accepted / drafts if drafts else 1.0


def acceptance_se(per_position: list[int], drafts: int) -> float:
    """The standard error of the pooled acceptance length from the steps' accepted counts,
    treating steps as independent: a step accepting a drafts counts at each position up to a,
    so with c_j the steps that kept position j (1-based), E[a] = sum c_j / n and, as
    a^2 = sum over j <= a of (2j - 1), E[a^2] = sum (2j - 1) c_j / n. 0 for under two steps."""
    if drafts < 2:
        return 0.0
    mean = sum(per_position) / drafts
    square = sum((2 * j + 1) * c for j, c in enumerate(per_position)) / drafts
    return math.sqrt(max(square - mean * mean, 0.0) / drafts)


@dataclass
class ValDecoder:
    """Greedy speculative decoding of `prompts` with a trainee's current head: `__call__(trainee)`
    -> (the pooled mean acceptance length, its standard error: `acceptance_se`). Rank 0 calls it
    (see `trainer.loop`)."""

    target: object
    prompts: list[torch.Tensor]
    shape: Shape
    max_new_tokens: int
    eos: tuple[int, ...]

    def __call__(self, trainee) -> tuple[float, float]:
        was_training = trainee.training
        trainee.eval()
        drafter, verifier = trainee.drafter(self.target)
        stats = [speculative_generate(verifier, drafter, ids, self.max_new_tokens, self.shape, GREEDY,
                                      self.eos).stats for ids in self.prompts]
        trainee.train(was_training)
        accepted, drafts = sum(s.accepted_tokens for s in stats), sum(s.drafts for s in stats)
        return pooled_acceptance_length(accepted, drafts), acceptance_se(pooled_per_position(stats), drafts)


def build_val_decoder(cfg: RootConfig, trainee, target, val_ds) -> ValDecoder | None:
    """The decoded validation `cfg.optim` asks for (None: off), checked before training: a
    Medusa head refuses a shape it cannot draft here, not at the first validation."""
    n = cfg.val_decode_prompts
    if n == 0 or len(val_ds) == 0:
        return None
    model, tokenizer = target
    shape = draft_shape(cfg.eval, resolve_mode(cfg.eval.mode, cfg.head.name))
    drafter, verifier = trainee.drafter(model)
    if isinstance(drafter, MedusaDrafter):
        drafter.check(shape)
    prompts = [prompt_ids(val_ds[i]) for i in spread(len(val_ds), n)]
    eos = tuple(sorted(eos_token_ids(verifier, tokenizer)))
    return ValDecoder(model, prompts, shape, cfg.optim.val_decode_tokens, eos)


def resolve_decoding(cfg: RootConfig, planned: int | None = None) -> tuple[RootConfig, str | None]:
    """`cfg` with decoded validation decided: `optim.val_decode_prompts` a number
    (`RootConfig.val_decode_prompts`; where the default was left to a time budget, the prompts
    the plan fitted, `planned`: `Plan.decode_prompts`, 0 for none; None: no plan) and
    `optim.select_by` simulated or decoded (`selection.chosen_by`); and the one line that says
    why the default is off here (None: on, or the user chose)."""
    n, line = cfg.val_decode_prompts, None
    if cfg.optim.val_decode_prompts is None:
        why = cfg.val_decode_off()
        if why is None and planned is not None:
            n = planned
        if why is None and planned == 0:
            why = (f"the plan has no room for even {MIN_VAL_DECODE_PROMPTS} prompts in "
                   f"{VAL_DECODE_SHARE:.0%} of budget={cfg.budget}")
        if why is not None:
            line = off_line(why, cfg.optim.select_by)
    by = chosen_by(cfg.optim.select_by, n > 0)
    return derive(cfg, {"optim.val_decode_prompts": n, "optim.select_by": by}), line


def off_line(why: str, select_by: str) -> str:
    """The one line a run whose default decoded validation is off prints."""
    kept = " and keeps the head by it" if select_by == "auto" else ""
    return f"decoded validation off ({why}): validation reports the simulated acceptance length only{kept}"


def decoder_or_off(asked: RootConfig, cfg: RootConfig, trainee, target,
                   val_ds) -> tuple[RootConfig, ValDecoder | None, str | None]:
    """(the run's config, its decoded validation, None) as `build_val_decoder` builds it; where
    decoded validation was left to its default (`asked`: the config as the user gave it) and the
    head cannot draft the evaluator's shape (fewer Medusa heads than the tree), off instead of
    refused: the config derived again, and the line that says so. The user's own number, or
    `optim.select_by=decoded`, is refused as before."""
    try:
        return cfg, build_val_decoder(cfg, trainee, target, val_ds), None
    except UserError as err:
        o = asked.optim
        if o.val_decode_prompts is not None or o.select_by == "decoded":
            raise
        off = derive(cfg, {"optim.val_decode_prompts": 0, "optim.select_by": chosen_by(o.select_by, False)})
        return off, None, off_line(str(err), o.select_by)
