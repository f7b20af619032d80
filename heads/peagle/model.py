"""The P-EAGLE draft head: an EAGLE-3 head that proposes K tokens in one forward.

What vLLM 0.32 serves with `parallel_drafting` (`model_executor/models/llama_eagle3.py`,
`v1/spec_decode/llm_base_proposer.py`): after the verified positions (each the EAGLE-3 pair of a
target feature and the token that follows it, the last one pairing the last verified token with
the bonus token), K-1 "mask slots" at the next positions, all in one causal forward. A mask slot's
input id is the mask token (`pard_token` / `mask_token_id`, embedded with the target's embedding)
and its hidden state is `fc(input_norm(mask_hidden))`: `mask_hidden` [1, n_aux * Ht] lives in the
pre-fc aux space and goes through `fuse` as a target feature does (fc_norm too, once EAGLE-3 has
it). Slot k's logits draft the k-th token. Everything else is `Eagle3Head`: the layer, the norms,
the draft vocabulary, the folder format (plus `mask_hidden` and the two config keys).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from conf.errors import UserError
from conf.kinds import PEagleConfig
from heads.eagle3 import model as eagle3
from heads.eagle3.model import Eagle3Head

# The same captured layers as EAGLE-3: three aux features and the final hidden state (teacher).
captured_layers = eagle3.captured_layers


def resolve_mask_token_id(asked: int | None, target_config) -> int:
    """`head.mask_token_id`, checked against the target's vocabulary, or its default: the
    target's pad token, else its eos (see `conf.kinds.PEagleConfig`)."""
    text = target_config.get_text_config()
    vocab = text.vocab_size
    if asked is None:
        for name in ("pad_token_id", "eos_token_id"):
            found = getattr(text, name, None)
            found = found[0] if isinstance(found, (list, tuple)) and found else found
            if isinstance(found, int) and 0 <= found < vocab:
                return found
        raise UserError(
            "head.mask_token_id=null: the target's config names no pad or eos token inside its "
            f"vocabulary of {vocab}; set head.mask_token_id=<id>"
        )
    if not 0 <= asked < vocab:
        raise UserError(f"head.mask_token_id={asked}: expected an id below the target's vocab_size {vocab}")
    return asked


def check_target(cfg: PEagleConfig, target_config) -> None:
    """`head.mask_token_id` resolves for this target (`HeadKind.check_target`)."""
    resolve_mask_token_id(cfg.mask_token_id, target_config)


class PEagleHead(Eagle3Head):
    """`Eagle3Head` plus the learned `mask_hidden` and, in its config, the mask token id and the
    K (`parallel_tokens`) it was trained for."""

    kind = "peagle"

    def __init__(self, config: LlamaConfig, target):
        super().__init__(config, target)
        self.mask_token_id = int(config.mask_token_id)
        self.parallel_tokens = int(config.parallel_tokens)
        fused = len(self.aux_layer_ids) * config.target_hidden_size
        # The peers start it at N(0, 1), a target feature's scale after input_norm.
        self.mask_hidden = nn.Parameter(torch.randn(1, fused))

    @classmethod
    def draft_config(cls, target_config, cfg: PEagleConfig, draft_vocab_size: int) -> LlamaConfig:
        config = super().draft_config(target_config, cfg, draft_vocab_size)
        config.parallel_tokens = cfg.parallel_tokens
        config.mask_token_id = resolve_mask_token_id(cfg.mask_token_id, target_config)
        return config

    def mask_state(self) -> torch.Tensor:
        """[1, H]: the hidden state every mask slot reads, as vLLM computes it once per engine
        (`combine_hidden_states(mask_hidden)`)."""
        return self.fuse(self.mask_hidden.to(self.fc.weight.dtype))

    def with_mask_slots(
        self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, ids, positions) [1, T, ...] of verified positions with `slots` mask slots
        appended at the positions after the last: the one draft forward's inputs."""
        after = positions[:, -1:] + torch.arange(1, slots + 1, device=positions.device)
        mask_ids = torch.full((ids.shape[0], slots), self.mask_token_id, device=ids.device, dtype=ids.dtype)
        mask_hidden = self.mask_state().to(hidden.dtype).expand(hidden.shape[0], slots, -1)
        return (
            torch.cat([hidden, mask_hidden], 1),
            torch.cat([ids, mask_ids], 1),
            torch.cat([positions, after], 1),
        )


def load_for_decoding(path: str | Path, target_model, target_name: str) -> tuple[PEagleHead, object]:
    """EAGLE-3's loading with this head class: another target or missing aux layers are refused."""
    head, verifier = eagle3.load_for_decoding(path, target_model, target_name, PEagleHead)
    return head, verifier
