"""Decoded validation: the built-in decoder runs a few validation prompts with the head in
training, so that the kept head can be the one that decodes best (`optim.select_by=decoded`).

The simulated acceptance length assumes each draft step independent and right-prefixed; real
acceptance can peak and fall while it keeps rising (heads trained past their best). This runs the
evaluator's own decoder (`trainer.decoding`), shape and counting, greedy, on prompts of the
validation split: what the data's answers continue from, never the evaluation's tasks.

`optim.val_decode_prompts=n` decodes n prompts per validation (the `eval.*` shape, greedy,
`eval.max_new_tokens`) and logs `decoded_acceptance_length`; rank 0 decodes (not with ZeRO-3).
`optim.select_by=decoded` (needs n > 0) keeps, evaluates and exports the head with the best
decoded figure; summary.json names its `best_step`, and checkpoints carry the best so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conf.schema import RootConfig
from data_prep.target import eos_token_ids
from trainer.decoding import GREEDY, MedusaDrafter, speculative_generate
from trainer.decoding.drafters import Shape
from trainer.evaluate.run import draft_shape, resolve_mode


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


@dataclass
class ValDecoder:
    """Greedy speculative decoding of `prompts` with a trainee's current head: `__call__(trainee)`
    -> the pooled mean acceptance length. Rank 0 calls it (see `trainer.loop`)."""

    target: object
    prompts: list[torch.Tensor]
    shape: Shape
    max_new_tokens: int
    eos: tuple[int, ...]

    def __call__(self, trainee) -> float:
        was_training = trainee.training
        trainee.eval()
        drafter, verifier = trainee.drafter(self.target)
        accepted = drafts = 0
        for ids in self.prompts:
            stats = speculative_generate(
                verifier, drafter, ids, self.max_new_tokens, self.shape, GREEDY, self.eos
            ).stats
            accepted, drafts = accepted + stats.accepted_tokens, drafts + stats.drafts
        trainee.train(was_training)
        return pooled_acceptance_length(accepted, drafts)


def build_val_decoder(cfg: RootConfig, trainee, target, val_ds) -> ValDecoder | None:
    """The decoded validation `cfg.optim` asks for (None: off), checked before training: a
    Medusa head refuses a shape it cannot draft here, not at the first validation."""
    n = cfg.optim.val_decode_prompts
    if n == 0 or len(val_ds) == 0:
        return None
    model, tokenizer = target
    shape = draft_shape(cfg.eval, resolve_mode(cfg.eval.mode, cfg.head.name))
    drafter, verifier = trainee.drafter(model)
    if isinstance(drafter, MedusaDrafter):
        drafter.check(shape)
    prompts = [prompt_ids(val_ds[i]) for i in spread(len(val_ds), n)]
    eos = tuple(sorted(eos_token_ids(verifier, tokenizer)))
    return ValDecoder(model, prompts, shape, cfg.eval.max_new_tokens, eos)
