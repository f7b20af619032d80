"""Random-weight heads saved in the project's folder format, for the tests that read, evaluate,
export or serve a head without training one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from conf.kinds import DFlashConfig, DSparkConfig, Eagle3Config, MedusaConfig
from data_prep.target import load_target
from heads.dflash.model import DFlashHead
from heads.dspark.model import DSparkHead
from heads.eagle3.model import Eagle3Head
from heads.medusa.model import MedusaHead
from tests.support.targets import hf_greedy
from trainer.decoding import Chain, speculative_generate

DRAFT_VOCAB = 512
# The original EAGLE-3 layout (no extra norms), which test_export's exact key sets describe; the
# norm variants (on by default) have their own tests there.
ORIGINAL_LAYOUT = Eagle3Config(norm_before_fc=False, norm_before_residual=False, norm_output=False)
MEDUSA_HEADS, MEDUSA_LAYERS = 3, 2


def eagle_head(model, name: str, out: Path, aux: list[int] | None = None) -> Path:
    """An EAGLE-3 head at its initial weights drafting over the whole vocabulary."""
    v = model.config.vocab_size
    d2t, t2d = torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    cfg = Eagle3Config(aux_layer_ids=aux)
    head = Eagle3Head.from_target(model, name, cfg, d2t, t2d)
    return head.save_pretrained(out)


def make_eagle3_head(
    target_dir: Path, out: Path, seed: int = 0, cfg: Eagle3Config | None = None,
    draft_vocab: int = DRAFT_VOCAB, head_class: type[Eagle3Head] = Eagle3Head,
) -> Path:
    """A fresh EAGLE-3 head (or `head_class`, a kind built on it, with its `cfg`) with a reduced,
    non-contiguous draft vocabulary of `draft_vocab` ids (so d2t matters)."""
    model, _ = load_target(str(target_dir))
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    keep = torch.sort(torch.randperm(v, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[keep] = True
    torch.manual_seed(seed)
    d2t = keep - torch.arange(draft_vocab)
    head = head_class.from_target(model, str(target_dir), cfg or ORIGINAL_LAYOUT, d2t, t2d)
    with torch.no_grad():  # move the norms off 1.0 so a dropped or swapped norm weight would show
        for name, p in head.named_parameters():
            if "norm" in name:  # every RMSNorm's weight: the layer's, input_norm, fc_norm.{i}
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return head.save_pretrained(out)


def make_medusa_head(target, name: str, out: Path, fc_bias: bool, seed: int = 0) -> Path:
    """A Medusa head of `MEDUSA_HEADS` heads, `MEDUSA_LAYERS` blocks each, every tensor moved off
    its identity start."""
    head = MedusaHead.from_target(
        target, name, MedusaConfig(num_heads=MEDUSA_HEADS, num_layers=MEDUSA_LAYERS, fc_bias=fc_bias)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # leave the identity start so every tensor matters
        for p in head.blocks.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return head.save_pretrained(out)


def random_dflash_head(target, name: str = "tiny", seed: int = 0, head_class: type[DFlashHead] = DFlashHead,
                       config_class: type[DFlashConfig] = DFlashConfig, **cfg) -> DFlashHead:
    """A DFlash head (or a derived kind's: DSpark's) with mask token 3 and every trainable tensor
    moved off its init, each layer's norms their own, so that a dropped, swapped or shared tensor
    shows in its outputs."""
    head = head_class.from_target(target, name, config_class(**{"num_layers": 2, **cfg}), mask_token_id=3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return head


def random_dspark_head(target, name: str = "tiny", seed: int = 0, **cfg) -> DSparkHead:
    """`random_dflash_head` of DSpark (Markov rank 8 unless given): its bias is not zero."""
    return random_dflash_head(target, name, seed, DSparkHead, DSparkConfig, **{"markov_rank": 8, **cfg})


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def not_utf8(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b'"kind"', b'"k\xe9ind"'))


def without_target(path: Path) -> None:
    meta = json.loads(path.read_text())
    del meta["target"]
    path.write_text(json.dumps(meta))


def features(target, head, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features [B, T, n*H], final hidden [B, T, H]) of rows ids [B, T]."""
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in head.aux_layer_ids], -1), hs[-1]


def batch_of(target, head, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> dict:
    aux, final = features(target, head, ids)
    mask = torch.ones_like(ids, dtype=torch.bool) if loss_mask is None else loss_mask
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids),
            "aux_hidden": aux, "final_hidden": final}


SEEDS = torch.randint(0, 256, (8, 4), generator=torch.Generator().manual_seed(3))


def assert_block_drafts_are_lossless(target, trainee, drafter_class) -> None:
    """A block drafter's trainee fitted for 30 steps (seconds) to the target's own greedy
    continuations of `SEEDS` (decoding from those prompts its head is accepted often, so that
    verification has accepted drafts to get wrong); then greedy speculative decoding with its
    drafter writes what transformers' `generate` does, token for token, and accepts some."""
    head = trainee.head
    rows = torch.stack([torch.cat([s, torch.tensor(hf_greedy(target, s.tolist(), 28))]) for s in SEEDS])
    batch = batch_of(target, head, rows)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        trainee(batch)["loss"].backward()
        opt.step()
    head.eval()
    accepted = 0
    for prompt in SEEDS[:4]:
        run = speculative_generate(target, drafter_class(head), prompt, 24, Chain(3))
        assert run.tokens == hf_greedy(target, prompt.tolist(), 24)
        accepted += run.stats.accepted_tokens
    assert accepted > 0


def gguf_tensor(t) -> torch.Tensor:
    """A `gguf.GGUFReader` tensor as torch, as the reader (what llama.cpp's loader sees) holds it:
    BF16 from its raw 16-bit words, in ggml's shape order flattened as stored."""
    data = np.array(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)
