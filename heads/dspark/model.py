"""The DSpark draft head: DFlash's block drafter (`heads.dflash`) plus a Markov logit bias and a
confidence head, laid out as vLLM 0.32 serves `method: dspark` (`model_executor/models/
qwen3_dspark.py`, proposer `v1/worker/gpu/spec_decode/dspark/speculator.py`).

What DSpark adds, with vLLM's names (the checkpoint's, so export renames nothing):
- `markov_head.markov_w1` [V, R] (an embedding of the previous token, by target id) and
  `markov_head.markov_w2` [V, R] (a linear R -> V): slot k's logits are DFlash's plus
  markov_w2 . markov_w1[prev_k], where prev_k is the token drawn at slot k-1, and for the first
  drafted slot the block's anchor (the last accepted token). vLLM samples the slots one after the
  other for this (`_sample_sequential`); our drafter does too. The peers' gated and rnn heads
  have no tensors vLLM 0.32 loads, so only this "vanilla" head is built (`conf.kinds.MARKOV_HEADS`);
- `confidence_head.proj` [1, H (+R)] with a bias: sigmoid(proj([hidden_k ; markov_w1[prev_k]])),
  in float32, the probability that slot k is accepted, trained against the target (the trainee's
  docstring); vLLM reads it only with adaptive verification, our decoder never.
The layout is DFlash's fill-in one (slot k >= 1 predicts the token at anchor + k, block_size - 1
drafts), written as `sample_from_anchor: false`, which vLLM serves beside the anchor layout the
peers default to. markov_w2 starts at zero, so a fresh head drafts as DFlash does.

Shapes checked against speculators (`models/dspark`), SpecForge (`modeling/draft/dspark.py`) and
vLLM 0.32's loader (`Qwen3DSparkForCausalLM.load_weights`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from conf.kinds import DSparkConfig
from heads.dflash import model as dflash
from heads.dflash.model import DFlashHead

# The config fields DSpark adds to DFlash's, as vLLM reads them from config.json.
FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


class MarkovHead(nn.Module):
    """The vanilla Markov head: a rank-R bigram correction of the draft's logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """[..., R] embeddings of previous tokens [...] (target ids)."""
        return self.markov_w1(prev)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        """[..., V] logit bias of `embed`'s output."""
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """One linear unit over [hidden ; markov embedding] (or the hidden alone): the logit of the
    probability that a slot's draft is accepted."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, embedded], -1) if self.with_markov else hidden
        return self.proj(x.float()).squeeze(-1)


class DSparkHead(DFlashHead):
    """DFlash's head with `markov_head` and (unless disabled) `confidence_head`."""

    kind = "dspark"

    def __init__(self, config: Qwen3Config, target):
        super().__init__(config, target)
        h, v, r = config.hidden_size, config.vocab_size, int(config.markov_rank)
        self.markov_head = MarkovHead(v, r)
        self.confidence_head = (ConfidenceHead(h, r, bool(config.confidence_head_with_markov))
                                if config.enable_confidence_head else None)

    @classmethod
    def head_config(cls, target_config, cfg: DSparkConfig, mask_token_id: int) -> Qwen3Config:
        config = super().head_config(target_config, cfg, mask_token_id)
        config.markov_rank = cfg.markov_rank
        config.markov_head_type = cfg.markov_head_type
        config.enable_confidence_head = cfg.confidence_head
        config.confidence_head_with_markov = cfg.confidence_with_markov
        return config

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """The Markov head's logit bias [..., V] for slots whose previous token is `prev` [...], in
        float32: added to the logits of a 16-bit lm_head (training stores the shared tables in its
        dtype) the sum stays float32, as it was when the tables were."""
        return self.markov_head.bias(self.markov_head.embed(prev)).float()

    def biased_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of slots' hidden states [..., H] whose previous token is `prev` [...]."""
        return self.logits(hidden) + self.bias(prev)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Float32 logits [...] of each slot's acceptance (the confidence head is present)."""
        return self.confidence_head(hidden, self.markov_head.embed(prev))


def load_for_decoding(path, target_model, target_name: str) -> tuple[DSparkHead, object]:
    """DFlash's loader, for a DSpark head."""
    return dflash.load_for_decoding(path, target_model, target_name, head_class=DSparkHead)
