"""The user's own target, whatever its family: one tiny random-weight target per architecture of
support/targets.py's `TINY_FAMILIES` (built from its config, no download: Llama with llama3 rope scaling,
Qwen2, Qwen3, Qwen3-MoE, Mistral sliding every layer, Gemma 3 with sliding and global layers,
gpt-oss where transformers builds it on this CPU, Phi-3), taken through the main job as a user's
own target is. 4 layers, so the default aux-layer ids are a shallow target's; a byte-level
tokenizer (259 ids), so the vocabulary costs nothing. For each family:

- capture: the features offline capture stores are the target's own forward's (its windows and
  layer types), and online training computes the very batches offline training reads, every kind;
- every head kind of the catalog (`heads.kinds.KINDS`) trains a few steps in the main job
  (`trainer.train.run`, in process);
- the regeneration engine, plain greedy decoding and speculative decoding with every trained head
  (chain, and tree unless the kind's record says `chains_only`) write what transformers'
  `generate` writes, 72 new tokens, far past a window;
- every export format of every kind, read back by its strict reader, is the trained head;
- the exported draft config's `max_position_embeddings`, `rope_theta` and `rope_scaling` are the
  target's (Gemma 3: its global layers').

40 main jobs (8 families x 5 kinds), in process: 120 s, the unit tier's largest module, in e2e
since #62 (the tiers' CI lanes share their queue, so CI runs it at the same cost). Without it
tests/unit/trainer/test_sliding_window.py still holds the sliding families' engine and decoders
to `generate`, and tests/unit/heads/ every kind's exports on the tiny llama.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from conf.compose import compose_root
from conf.errors import first_line
from conf.kinds import MedusaConfig
from data_prep.answers.regen_engine import generate
from data_prep.folders.store import CapturedDataset, load_manifest
from data_prep.masks import attention_layout
from data_prep.prepare import prepare
from data_prep.states.capture import length_batches
from data_prep.target import load_target
from heads.eagle3.model import Eagle3Head
from heads.export.write import formats_for, load_export
from heads.kinds import KINDS
from heads.medusa.model import MedusaHead
from tests.support.decode import SHAPES
from tests.support.runs import assert_online_batch_is_the_offline_batch, tiny_run_args, train_losses
from tests.support.targets import (
    TINY_FAMILIES,
    byte_tokenizer,
    hf_greedy,
    kind_takes,
    save_target,
    special_token_ids,
    tiny_family_target,
)
from trainer.decoding import greedy_generate, speculative_generate
from trainer.evaluate.run import load_drafter
from trainer.train import run

LAYERS, STEPS, NEW = 4, 4, 72
SLIDING = {"mistral", "gemma3_text", "gpt_oss"}
# Families transformers may fail to build or run on a CPU: skipped there, with the reason.
CPU_OPTIONAL = {"gpt_oss"}


@dataclass
class Family:
    """One family's target, loaded as the main job loads it, and its two main-job summaries."""

    name: str
    target_dir: Path
    model: torch.nn.Module
    tokenizer: object
    runs: dict[str, dict]

    def ran(self, head: str) -> None:
        """Skip a test of `head` where the family's target is not one it trains on (an MTP head
        needs the target's own MTP layers: tests/unit/heads/test_mtp.py, tests/e2e/test_mtp.py)."""
        if head not in self.runs:
            pytest.skip(f"+head={head} does not train on a {self.name} target")

    def exports(self, head: str) -> dict[str, Path]:
        """format -> the folder the main job exported it to."""
        return {Path(p).name: Path(p) for p in self.runs[head]["exports"]}

    def trained(self, head: str) -> torch.nn.Module:
        """The head `head`'s main job kept, loaded as the evaluator loads it."""
        return KINDS[head].load_for_decoding(self.runs[head]["head_dir"], self.model, str(self.target_dir))[0]


def main_job_args(head: str, target: Path, chat_file: Path, run_dir: Path, *extra: str) -> list[str]:
    """A seconds-long main job: a few steps, a draft vocabulary below the target's 259 ids, the
    capture's matmuls in the target's float32 (so it can be held to the target's own forward) and
    the export on (float32, so a read-back head must equal the trained one bit for bit)."""
    return tiny_run_args(
        head, target, chat_file, run_dir, f"optim.max_steps={STEPS}", "logging.log_every=1",
        "data.draft_vocab_size=128", "data.matmul_dtype=target", "data.hidden_states=offline",
        "pipeline.export=true", "export.dtype=float32", *extra,
    )


def build_target(family: str, out: Path) -> Path:
    """`family`'s tiny target with the byte tokenizer, saved as a user's target folder; a family
    of `CPU_OPTIONAL` that transformers cannot build or run here is skipped with the reason."""
    tok = byte_tokenizer()
    try:
        model = tiny_family_target(family, len(tok), num_hidden_layers=LAYERS, **special_token_ids(tok))
        model(torch.tensor([[1, 2, 3]]))
    except Exception as err:
        if family not in CPU_OPTIONAL:
            raise
        pytest.skip(f"transformers cannot build or run {family} on this CPU: {first_line(err)}")
    return save_target(model, tok, out)


@pytest.fixture(scope="module", params=list(TINY_FAMILIES))
def family(request, tmp_path_factory, chat_file, single_thread) -> Family:
    """The family's target folder and both heads' main jobs (prepare, train, export)."""
    root = tmp_path_factory.mktemp(request.param)
    target_dir = build_target(request.param, root / "target")
    config = AutoConfig.from_pretrained(target_dir)
    runs = {
        head: run(compose_root(main_job_args(head, target_dir, chat_file, root / head)))
        for head, kind in KINDS.items() if kind_takes(kind, config)
    }
    model, tokenizer = load_target(str(target_dir), dtype="float32", device="cpu")
    return Family(request.param, target_dir, model, tokenizer, runs)


def assert_capture_is_the_targets_forward(folder: Path, model, samples: int = 2) -> None:
    """The stored features of the first training samples are what the target's own forward over
    each sample alone computes (transformers' masks: its windows, sinks and layer types), up to
    the one rounding to bf16 storage."""
    data, manifest = CapturedDataset(folder, "train"), load_manifest(folder)
    for i in range(samples):
        item = data[i]
        hs = model(item["input_ids"][None], output_hidden_states=True).hidden_states
        layers = {"aux_hidden": manifest["aux_layer_ids"], "final_hidden": [manifest["final_layer_id"]]}
        for name in data.fields:
            want = torch.cat([hs[k][0] for k in layers[name]], -1).bfloat16().float()
            torch.testing.assert_close(item[name].float(), want, rtol=2**-7, atol=1e-4, msg=name)


def capture_batches(folder: Path) -> list[list[int]]:
    """The batches offline capture ran the first training shard in. Online batches of the same
    samples, padded alike, run the target's GEMMs at the same shapes: in float32 on a CPU another
    grouping may round differently (a few 1e-5), which a bf16 rounding can turn into one ulp.
    That the features do not depend on the grouping is `assert_capture_is_the_targets_forward`'s."""
    data = CapturedDataset(folder, "train")
    first = data.manifest["splits"]["train"]["shards"][0]["samples"]
    return length_batches(data.lengths[:first], data.manifest["data"]["capture_batch_tokens"])


@pytest.mark.parametrize("head", list(KINDS))
def test_capture_is_the_target_offline_and_online(family, head, chat_file):
    family.ran(head)
    summary = family.runs[head]
    assert summary["hidden_states"] == "offline"
    assert_capture_is_the_targets_forward(Path(summary["data_dir"]), family.model)
    run_dir = Path(summary["run_dir"])  # the same data cache: the online folder sits beside it
    online = prepare(
        compose_root(main_job_args(head, family.target_dir, chat_file, run_dir, "data.hidden_states=online"))
    ).path
    offline = Path(summary["data_dir"])
    assert_online_batch_is_the_offline_batch(offline, online, family.model, capture_batches(offline))


@pytest.mark.parametrize("head", list(KINDS))
def test_every_kind_trains(family, head):
    family.ran(head)
    summary = family.runs[head]
    assert summary["steps"] == STEPS and summary["skipped_steps"] == 0
    losses = train_losses(Path(summary["run_dir"]))
    assert len(losses) == STEPS and torch.isfinite(torch.tensor(losses)).all()
    trained = family.trained(head)
    if head in ("eagle3", "peagle"):  # the default ids of a 4-layer target: distinct, each a layer's
        assert trained.aux_layer_ids == [1, 2, 3] and trained.config.draft_vocab_size == 128
    if head != "medusa":
        assert losses[-1] < losses[0]
    else:  # Medusa's per-step loss is noisy over 4 steps; its fresh head is not (identity blocks,
        # the target's lm_head): every tensor of it has moved
        fresh = MedusaHead.from_target(family.model, str(family.target_dir), MedusaConfig()).state_dict()
        moved = {k: not torch.equal(v, fresh[k]) for k, v in trained.state_dict().items()}
        assert all(moved.values()), moved


def test_engine_and_decoders_write_what_generate_writes_past_the_window(family):
    """Prompts share a 20-token header, longer than the window, and run 3 to 40 tokens more; 72
    new tokens take every answer far past it. The engine runs 3 prompts in 2 slots (a refill);
    the decoder drafts with the heads the main job trained, in chain and tree shape, each (head,
    shape) on one of the first two prompts in turn: both prompt lengths are drafted past the
    window on every family, at half the decodes of each pair on both."""
    model = family.model
    assert attention_layout(model.config).sliding == (family.name in SLIDING)
    g = torch.Generator().manual_seed(0)
    header = torch.randint(0, 256, (20,), generator=g).tolist()
    prompts = [header + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 11)]
    want = [hf_greedy(model, p, NEW) for p in prompts]
    assert len(set(want[0])) >= 20  # varied text: a wrong mask or rope shows within a few tokens
    got = generate(model, prompts, max_new_tokens=NEW, batch_size=2, eos_token_ids=[], prefill_tokens=256)
    assert got == want
    for prompt, answer in zip(prompts, want):
        assert greedy_generate(model, torch.tensor(prompt), NEW).tokens == answer
    turn = 0
    for head in family.runs:
        kind = KINDS[head]
        shapes = SHAPES[:1] if kind.chains_only else SHAPES
        drafter, verifier = load_drafter(family.runs[head]["head_dir"], model, str(family.target_dir), shapes)
        for shape in shapes:
            prompt, answer = prompts[turn % 2], want[turn % 2]
            turn += 1
            tokens = speculative_generate(verifier, drafter, torch.tensor(prompt), NEW, shape).tokens
            assert tokens == answer, (head, shape)


@pytest.mark.parametrize("head", list(KINDS))
def test_every_export_reads_back_as_the_trained_head(family, head):
    family.ran(head)
    exports = family.exports(head)
    assert sorted(exports) == sorted(formats_for(family.runs[head]["head_dir"], None))
    want = KINDS[head].check.outputs(family.trained(head).eval())
    for fmt, folder in exports.items():
        got = KINDS[head].check.outputs(load_export(folder, family.model, str(family.target_dir)).eval())
        assert all(torch.equal(want[k], got[k]) for k in want), fmt


def test_draft_config_has_the_targets_positions_and_rope(family):
    """The legacy pair the engines read (`rope_theta`, `rope_scaling`) spells the target's rope
    exactly, and transformers reads it back as the target's `rope_parameters` (as vLLM does)."""
    text = AutoConfig.from_pretrained(family.target_dir).get_text_config()
    rope = dict(text.rope_parameters)
    rope = dict(rope.get("full_attention", rope))  # Gemma 3: its global layers' rope
    rope.pop("partial_rotary_factor", None)  # Phi-3's 1.0: every dimension rotates
    exports = family.exports("eagle3")
    native = json.loads((exports["eagle3"] / "config.json").read_text())
    layer = json.loads((exports["speculators"] / "config.json").read_text())["transformer_layer_config"]
    for cfg in (native, layer):
        assert cfg["max_position_embeddings"] == text.max_position_embeddings
        scaling = cfg["rope_scaling"] or {"rope_type": "default"}
        assert {**scaling, "rope_theta": cfg["rope_theta"]} == rope
        assert LlamaConfig(**cfg).rope_parameters == rope
    assert AutoConfig.from_pretrained(exports["eagle3"]).rope_parameters == rope
    head_dir = family.runs["eagle3"]["head_dir"]
    trained = Eagle3Head.from_pretrained(head_dir, family.model, str(family.target_dir))
    assert trained.config.rope_parameters == rope  # what it trained and drafts with
    assert trained.config.max_position_embeddings == text.max_position_embeddings
