"""The MTP kind on tiny DeepSeek-V3 and GLM-4.5 targets that carry their MTP layer as the vendors'
checkpoints do (`scripts/build_mtp_target.py`): the layer read from the safetensors is the one in
them, trains, drafts losslessly through the chain drafter with a cache that computes what one
causal pass would, exports a stitched target that differs from the original only in the MTP
tensors, and a target without MTP layers is refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from conf.errors import UserError
from conf.kinds import MtpConfig
from heads.export.write import export_head
from heads.mtp.export import SPEC_PREFIX, SPECULATORS, STITCHED, read_speculators, stitched_differences
from heads.mtp.model import SHARED, MtpHead, check_target, read_checkpoint_layer
from scripts.build_mtp_target import FAMILIES, MTP, build_mtp_target
from tests.support.targets import byte_tokenizer, hf_greedy
from trainer.decoding import Chain, speculative_generate
from trainer.decoding.mtp import MtpDrafter
from trainer.decoding.verify import GREEDY as GREEDY_SAMPLING
from trainer.kinds.mtp import MtpTrainee, step_weights

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory):
    """(folder, model) of a tiny target of each MTP family."""
    folder = build_mtp_target(tmp_path_factory.mktemp(request.param), request.param, byte_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    return folder, model


def batch_of(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    final = model(ids, output_hidden_states=True).hidden_states[-1]
    return {"input_ids": ids, "final_hidden": final, "loss_mask": torch.ones_like(ids, dtype=torch.bool),
            "attention_mask": torch.ones_like(ids)}


def test_the_head_holds_the_checkpoints_mtp_layer_and_writes_it_back_in_its_names(target):
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    shipped = read_checkpoint_layer(folder, model.config.num_hidden_layers)
    written = head.checkpoint_tensors()
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    assert sorted(written) == sorted(prefix + k for k in shipped if k not in SHARED)
    assert all(torch.equal(written[prefix + k], v) for k, v in shipped.items() if k not in SHARED)
    assert not any(p.requires_grad for p in (head.embed_tokens.weight, head.lm_head.weight))


def test_a_target_without_mtp_layers_is_refused_in_one_line_naming_the_families():
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)
    with pytest.raises(UserError, match=r"\+head=mtp: .*\(llama\) has no multi-token-prediction layers.*"
                       "deepseek_v3, glm4_moe") as err:
        check_target(MtpConfig(), config)
    assert "\n" not in str(err.value)


def test_a_target_resaved_by_transformers_without_its_mtp_layer_is_refused(target, tmp_path):
    folder, model = target
    model.save_pretrained(tmp_path / "resaved")  # transformers drops the MTP layer
    config = AutoConfig.from_pretrained(tmp_path / "resaved")
    lacks = r"declares MTP layers but its safetensors hold nothing.*head.init=scratch"
    with pytest.raises(UserError, match=lacks):
        check_target(MtpConfig(), config)
    check_target(MtpConfig(init="scratch"), config)
    check_target(MtpConfig(), AutoConfig.from_pretrained(folder))


def test_a_target_of_several_mtp_layers_is_refused(target):
    config = AutoConfig.from_pretrained(target[0])
    config.num_nextn_predict_layers = 2
    with pytest.raises(UserError, match="declares 2 MTP layers .* this kind trains one"):
        check_target(MtpConfig(), config)


def test_step_weights_are_fastmtps_normalised_decay():
    assert step_weights(0.6, 3) == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])


def test_training_moves_only_the_mtp_layer_and_lowers_the_loss(target):
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    trainee = MtpTrainee(head, 3, 0.6)
    frozen = {k: v.clone() for k, v in head.state_dict().items() if k.startswith(("embed_tokens", "lm_head"))}
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = batch_of(model, ids)
    opt = torch.optim.AdamW(trainee.param_groups(3e-3, 0.0)[0]["params"], lr=3e-3)
    losses = []
    for _ in range(8):
        loss = trainee(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(head.state_dict()[k], v) for k, v in frozen.items())


@torch.no_grad()
def test_the_drafters_second_step_is_one_causal_pass_over_the_chain(target):
    """Step 1 reads the cache of step 0's verified positions and its own input: one causal pass
    over [step 0's inputs ; step 1's] computes the same logits."""
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    prompt = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    final = model(prompt[None], output_hidden_states=True).hidden_states[-1][0]
    nxt = 7
    drafter = MtpDrafter(head)
    drafter.start(prompt, [final], nxt)
    draft = drafter.propose(Chain(2), GREEDY_SAMPLING).tokens.tolist()
    following = torch.cat([prompt[1:], torch.tensor([nxt])])
    pos = torch.arange(10)[None]
    feed, logits, _ = head.step(final[None], following[None], pos)
    assert draft[0] == int(logits[0, -1].argmax())
    hidden = torch.cat([final[None], feed[:, -1:]], 1)
    ids = torch.cat([following, torch.tensor([draft[0]])])[None]
    _, chained, _ = head.step(hidden, ids, torch.arange(11)[None])
    assert draft[1] == int(chained[0, -1].argmax())


@torch.no_grad()
def test_greedy_decoding_with_the_mtp_layer_equals_generate(target):
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    out = speculative_generate(model, MtpDrafter(head), prompt, 40, Chain(3))
    assert out.tokens == hf_greedy(model, prompt.tolist(), 40)


def test_stitched_export_changes_only_the_mtp_tensors_and_links_the_rest(target, tmp_path):
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    with torch.no_grad():
        head.eh_proj.weight.add_(0.5)  # a "fine-tuned" layer
    head.save_pretrained(tmp_path / "head")
    out, report = export_head(tmp_path / "head", STITCHED, tmp_path / "stitched", model, dtype="float32")
    assert report["outputs_identical"]
    diff = stitched_differences(folder, out)
    n = model.config.num_hidden_layers
    assert diff["changed"] == [f"model.layers.{n}.eh_proj.weight"] and diff["missing"] == []
    assert MTP not in diff["linked"]
    assert {"config.json", "model.safetensors.index.json"} <= set(diff["linked"])
    assert all((out / name).resolve() == (folder / name).resolve() for name in diff["linked"])
    with safe_open(out / MTP, "pt") as f:
        assert torch.equal(f.get_tensor(f"model.layers.{n}.eh_proj.weight"), head.eh_proj.weight)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))


def test_speculators_export_holds_the_layer_in_its_names(target, tmp_path):
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    head.save_pretrained(tmp_path / "head")
    out, report = export_head(tmp_path / "head", SPECULATORS, tmp_path / "spec", model, dtype="float32")
    assert report["outputs_identical"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {f"{SPEC_PREFIX}{k}.weight" for k in ("hidden_layernorm", "token_layernorm", "input_proj",
                                                   "final_layernorm")} <= names
    assert all(n.startswith(SPEC_PREFIX) for n in names)
    cfg, _ = read_speculators(out)
    assert cfg["num_steps"] == 3 and "method" not in cfg
    assert '{"method": "mtp", "num_speculative_tokens": 3}' in (out / "README.md").read_text()





@torch.no_grad()
def test_grouped_experts_equal_the_targets_eager_experts(target):
    """The MTP layer's MoE runs transformers' grouped_mm experts (sync-free, `heads.mtp.model.EXPERTS`);
    the target's own eager loop over the experts computes the same."""
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9)
    grouped = head.step(hidden, ids, pos)[1]
    head.text_config._experts_implementation = "eager"
    eager = head.step(hidden, ids, pos)[1]
    torch.testing.assert_close(grouped, eager, atol=1e-5, rtol=1e-5)


def test_exports_self_check_without_the_target_as_the_export_cli_runs_it(target, tmp_path):
    folder, model = target
    MtpHead.from_target(model, str(folder), MtpConfig()).save_pretrained(tmp_path / "head")
    for fmt in (STITCHED, SPECULATORS):
        _, report = export_head(tmp_path / "head", fmt, tmp_path / fmt, None)
        assert report["outputs_identical"], fmt


@torch.no_grad()
def test_anchor_positions_change_only_the_later_steps(target):
    """speculators' recipe (`head.step_positions=anchor`) runs every step at the anchor's position:
    step 0 is the default's, the later steps are not."""
    folder, model = target
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = batch_of(model, ids)
    first = [MtpTrainee(head, 1, 0.6, drafted_positions=d)(batch)["loss"] for d in (True, False)]
    later = [MtpTrainee(head, 3, 0.6, drafted_positions=d)(batch)["loss"] for d in (True, False)]
    assert torch.equal(first[0], first[1]) and not torch.equal(later[0], later[1])
