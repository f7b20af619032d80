"""Medusa heads and their losses on tiny real targets: identity at init, label offsets, the folder
format, and the chunked loss against plain full-logit maths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from conf.errors import UserError
from conf.kinds import Eagle3Config, MedusaConfig
from heads.eagle3.model import Eagle3Head
from heads.medusa.model import MedusaHead, load_joint_target
from trainer.kinds.medusa import head_losses, offset_labels, token_loss


def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[-1]


def test_fresh_head_is_the_target_lm_head(tiny_model):
    """Zero-initialised ResBlocks are the identity, so every head starts as the target itself."""
    head = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=3, num_layers=2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        out = tiny_model(ids, output_hidden_states=True)
        logits = head(out.hidden_states[-1])
    assert logits.shape == (3, 2, 9, tiny_model.config.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=0, atol=1e-5)


def test_parameter_names_are_vllm_names_and_blocks_are_separate(tiny_model):
    head = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=2, num_layers=2))
    names = {n for n, _ in head.named_parameters()}
    expected = {
        f"blocks.{h}.layers.{i}.{p}" for h in range(2) for i in range(2) for p in ("weight", "bias")
    }
    assert names == expected | {"lm_heads.0.weight", "lm_heads.1.weight"}
    ptrs = {p.data_ptr() for p in head.parameters()}
    assert len(ptrs) == len(names)  # no module repeated, no tensor shared
    assert head.config["fc_bias"] is True and head.config["target_update"] is None
    no_bias = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=1, fc_bias=False))
    no_bias_names = {n for n, _ in no_bias.named_parameters()}
    assert no_bias_names == {"blocks.0.layers.0.weight", "lm_heads.0.weight"}


def test_head_k_labels_are_the_tokens_k_plus_2_ahead():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[False, False, False, True, True, True, False]])
    labels, valid = offset_labels(ids, mask, 2)  # head 0
    assert labels.tolist() == [[12, 13, 14, 15, 16, 0, 0]]
    assert valid.tolist() == [[False, True, True, True, False, False, False]]
    labels, valid = offset_labels(ids, mask, 3)  # head 1
    assert labels.tolist() == [[13, 14, 15, 16, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, False, False, False, False]]
    # head 1 at position 0 is trained to predict 13 (3 ahead); position 3 predicts 16 but 16 is
    # outside the loss mask, so it is not trained.


def test_training_loss_matches_the_forward_api_on_a_hand_made_sequence(tiny_model):
    """head_losses (chunked rows) == CE of head(final_hidden)[k] at t vs input_ids[t+2+k]."""
    torch.manual_seed(0)
    head = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=3))
    for p in head.blocks.parameters():
        p.data.normal_(0, 0.1)
    ids = torch.tensor([[5, 900, 31, 77, 1200, 8, 450, 3000, 61]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    hidden = final_hidden(tiny_model, ids)
    with torch.no_grad():  # validation mode: hits are counted
        loss, sums = head_losses(head, hidden, ids, mask, head_weight=0.5)
        logits = head(hidden)[:, 0]
    expected = 0.0
    for k in range(3):
        positions = [t for t in range(9 - 2 - k) if mask[0, t + 2 + k]]
        targets = ids[0, [t + 2 + k for t in positions]]
        ce = F.cross_entropy(logits[k, positions], targets)
        expected += 0.5**k * ce
        assert sums["head_total"][k] == len(positions)
        top1 = (logits[k, positions].argmax(-1) == targets).sum()
        assert sums["head_top1"][k] == top1
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("keep_bytes", [0, 2**20], ids=["checkpointed-chunks", "kept-logits"])
def test_chunked_loss_equals_plain_maths_with_gradients(keep_bytes):
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 50, bias=False)
    teacher = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(13, 8, requires_grad=True)
    th = torch.randn(13, 8)
    labels = torch.randint(0, 50, (13,))

    ce, top1, top5 = token_loss(proj, h, labels, chunk=4, keep_bytes=keep_bytes)
    assert top1 == top5 == 0  # not counted while training
    ce.backward()
    grads = (h.grad.clone(), proj.weight.grad.clone())
    h.grad = proj.weight.grad = None
    logits = proj(h)
    plain = F.cross_entropy(logits, labels, reduction="sum")
    plain.backward()
    torch.testing.assert_close(ce, plain)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], proj.weight.grad)
    with torch.no_grad():
        _, top1, top5 = token_loss(proj, h, labels, chunk=4)
    assert top1 == (logits.argmax(-1) == labels).sum()
    assert top5 == (logits.topk(5, -1).indices == labels[:, None]).any(-1).sum()

    h.grad = None
    kl, _, _ = token_loss(proj, h, labels, teacher, th, chunk=5, keep_bytes=keep_bytes)
    kl.backward()
    kl_grad, h.grad = h.grad, None
    t_logp = F.log_softmax(teacher(th), -1)
    plain_kl = F.kl_div(F.log_softmax(proj(h), -1), t_logp, log_target=True, reduction="sum")
    plain_kl.backward()
    torch.testing.assert_close(kl, plain_kl)
    torch.testing.assert_close(kl_grad, h.grad)
    with torch.no_grad():
        _, agree, _ = token_loss(proj, h, labels, teacher, th, chunk=5)
    assert agree == (proj(h).argmax(-1) == t_logp.argmax(-1)).sum()


def test_save_load_roundtrip_and_state_override(tiny_model, tmp_path):
    head = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=2))
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.01)
    head.save_pretrained(tmp_path / "h")
    loaded = MedusaHead.from_pretrained(tmp_path / "h", tiny_model, "moved/tiny")
    x = torch.randn(1, 4, 64)
    torch.testing.assert_close(loaded(x), head(x), rtol=0, atol=0)
    assert loaded.num_heads == 2 and loaded.num_layers == 1 and loaded.target == head.target
    assert load_joint_target(tmp_path / "h", tiny_model) is tiny_model  # Medusa-1: the target unchanged

    zeros = {k: torch.zeros_like(v) for k, v in head.state_dict().items()}
    head.save_pretrained(tmp_path / "z", state=zeros)
    assert all(
        (p == 0).all() for p in MedusaHead.from_pretrained(tmp_path / "z", tiny_model, "t").parameters()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h", "z"]  # no temp folders left


def test_heads_for_another_target_are_refused(tiny_model, tmp_path):
    MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=1)).save_pretrained(tmp_path / "h")
    other_cfg = LlamaConfig(
        vocab_size=tiny_model.config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    )
    other = AutoModelForCausalLM.from_config(other_cfg)
    with pytest.raises(UserError, match="num_hidden_layers 8 != 4"):
        MedusaHead.from_pretrained(tmp_path / "h", other, "other")


def test_an_eagle3_folder_is_not_a_medusa_head(tiny_model, tmp_path):
    vocab = tiny_model.config.vocab_size
    d2t, t2d = torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    eagle = Eagle3Head.from_target(tiny_model, "tiny", Eagle3Config(), d2t, t2d)
    eagle.save_pretrained(tmp_path / "e")
    with pytest.raises(UserError, match="a 'eagle3' head, expected 'medusa'"):
        MedusaHead.from_pretrained(tmp_path / "e", tiny_model, "tiny")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_heads": 0}, "head.num_heads=0"),
        ({"num_layers": 0}, "head.num_layers=0"),
        ({"lora_rank": 4}, "head.lora_rank=4: expected 0, or > 0 together with"),
    ],
)
def test_bad_head_settings_are_refused_by_the_schema(fields, message):
    with pytest.raises(UserError, match=message):
        MedusaConfig(**fields)
