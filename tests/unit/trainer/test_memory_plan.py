"""The memory plan (`trainer.plan.memory`) on a tiny llama's config, on the meta device: the bytes
of known parts equal hand-computed ones, offline holds fewer target bytes than online, ZeRO shards
what it shards by the world, and the refusal names the settings that shrink a run. No GPU is
needed: the plan takes the device's type, and the refusal its capacity, as arguments."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from conf.compose import compose_root
from tests.support.targets import TINY
from trainer.plan.memory import check_memory_plan, plan_memory, refusal

VOCAB, DRAFT, H = 512, 100, TINY["hidden_size"]
CUDA = torch.device("cuda")  # a device type only: nothing is allocated on it
BF16 = 2


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **TINY)


def plan(*overrides: str, world: int = 1, mode: str | None = None):
    cfg = compose_root(["+head=eagle3", f"data.draft_vocab_size={DRAFT}", "target.dtype=auto",
                        "dist.mixed_precision=bf16", *overrides])
    return plan_memory(cfg, tiny_config(), CUDA, world, mode)


def test_offline_holds_the_embeddings_lm_head_and_final_norm_of_the_target_in_its_dtype():
    offline = plan(mode="offline")
    # target.dtype=auto on a CUDA device: bfloat16; untied input and output embeddings, the norm
    assert offline.target == (2 * VOCAB * H + H) * BF16
    online = plan(mode="online")
    assert online.target == online.target_whole > offline.target
    assert offline.target_whole == online.target_whole


@pytest.mark.parametrize("precision, table_bytes", [("bf16", BF16), ("no", 4)])
def test_the_trainee_frozen_tables_are_priced_as_built(precision, table_bytes):
    """EAGLE-3's trainee: the frozen embedding and the teacher's draft rows as the code stores
    them (in the training dtype: bf16 under mixed precision, float32 without), the vocabulary
    maps, and the rotary tables (head_dim/2 float32 values, twice, whatever the precision)."""
    p = plan(f"dist.mixed_precision={precision}", mode="offline")
    head_dim = H // TINY["num_attention_heads"]
    rotary = 2 * head_dim // 2 * 4
    expected = (VOCAB * H + DRAFT * H) * table_bytes + VOCAB * 8 + DRAFT * 8 + VOCAB + rotary
    assert p.frozen == expected


def test_ddp_keeps_full_gradients_with_their_buckets_and_two_float32_moments():
    p = plan("dist=ddp", world=2)
    trained = p.trainable // 4  # DDP keeps the float32 parameters as built
    assert p.gradients == 2 * 4 * trained and p.optimizer == 8 * trained


def test_zero2_shards_gradients_and_optimizer_by_the_world_and_zero1_the_optimizer_only():
    one, four = plan("dist=zero2", world=1), plan("dist=zero2", world=4)
    trained = one.trainable // BF16  # DeepSpeed stores the parameters in bf16 ...
    assert one.optimizer == 12 * trained  # ... with a float32 master copy beside the moments
    assert four.optimizer == one.optimizer // 4 and four.gradients == one.gradients // 4
    assert four.trainable == one.trainable  # ZeRO-2 keeps every parameter on every rank
    zero1 = plan("dist=zero1", world=4)
    assert zero1.optimizer == four.optimizer and zero1.gradients == one.gradients


def test_activations_grow_with_the_tokens_of_a_micro_batch_and_the_ttt_steps():
    base = plan("optim.batch_tokens=1024")
    assert plan("optim.batch_tokens=2048").activations == 2 * base.activations
    assert plan("optim.batch_tokens=1024", "head.ttt_length=7").activations > base.activations


def test_rank_0_holds_the_whole_target_only_where_it_decodes():
    evaluates = plan(mode="offline")
    assert evaluates.rank0 == evaluates.training_rank + evaluates.target_whole - evaluates.target
    decodes = plan("pipeline.evaluate=false", mode="offline")  # decoded validation, by default
    assert decodes.rank0 == evaluates.rank0
    quiet = plan("pipeline.evaluate=false", "optim.val_decode_prompts=0", mode="offline")
    assert quiet.rank0 == quiet.training_rank


def test_a_plan_over_the_device_is_refused_naming_the_settings_to_change():
    p = plan("dist=ddp", world=8, mode="online")
    assert refusal(p, p.rank0) is None
    line = refusal(p, p.rank0 - 1)
    assert line.startswith("memory plan: a training rank holds")
    for setting in ("optim.batch_tokens=1024", "dist=zero2", "data.hidden_states=offline"):
        assert setting in line
    assert "\n" not in line


def test_rank_0_over_the_device_names_what_makes_it_decode():
    p = plan(mode="offline")
    line = refusal(p, p.training_rank)
    assert line.startswith("memory plan: rank 0 holds") and "pipeline.evaluate=false" in line


def test_check_memory_plan_on_a_cpu_plans_without_refusing():
    """A CPU's memory is the machine's (shared, swapped): nothing to refuse against."""
    cfg = compose_root(["+head=eagle3", f"data.draft_vocab_size={DRAFT}", "optim.batch_tokens=10000000"])
    assert check_memory_plan(cfg, tiny_config(), torch.device("cpu")).activations > 0


@pytest.mark.parametrize("kind", ["peagle", "dflash", "dspark", "medusa"])
def test_every_kind_is_planned(kind):
    cfg = compose_root([f"+head={kind}", f"data.draft_vocab_size={DRAFT}", "dist=ddp"])
    p = plan_memory(cfg, tiny_config(), CUDA, 2)
    assert p.trainable > 0 and p.optimizer == 2 * p.trainable and p.activations > 0

