"""`target.device_map`: a target placed by transformers layer by layer captures what the whole
target on one device captures, offline and online; a map that cannot be taken, or a stage that
needs the whole target on one device, is refused in one line naming `target.device_map`.

On a CPU every layer maps to the CPU, so no activation crosses a device here: these tests hold
the path (the map reaches `from_pretrained`, nothing moves the model afterwards, inputs go to
`input_device`); the last test compares a `balanced` split on a node of several GPUs."""

from __future__ import annotations

import pytest
import torch

from conf.errors import UserError
from conf.kinds import MedusaConfig
from conf.schema import OptimConfig, RootConfig, TargetConfig
from data_prep.prepare import check_source
from data_prep.states.capture import CaptureSpec, HfCapturer, capture_shard, checked_capture, pad_batch
from data_prep.target import input_device, output_device, resolve_target
from data_prep.template import Tokenized
from trainer.evaluate.run import evaluate


def layer_by_layer(config) -> dict[str, str]:
    """Every top-level module of a llama-shaped target, each named on its own."""
    layers = {f"model.layers.{i}": "cpu" for i in range(config.num_hidden_layers)}
    ends = {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    return {"model.embed_tokens": "cpu", **layers, **ends}


def target(folder, device_map=None):
    settings = TargetConfig(name_or_path=str(folder), device="cpu", num_threads=1, device_map=device_map)
    return resolve_target(RootConfig(target=settings))


@pytest.fixture(scope="module")
def whole_and_mapped(tiny_llama_dir):
    whole = target(tiny_llama_dir).load_model()
    mapped = target(tiny_llama_dir, layer_by_layer(whole.config)).load_model()
    return whole, mapped


def samples(lengths: list[int]) -> list[Tokenized]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, 40000, (n,), generator=g).tolist() for n in lengths]
    return [Tokenized(s, [True] * len(s), False) for s in ids]


def test_a_mapped_target_captures_the_whole_targets_hidden_states(whole_and_mapped):
    whole, mapped = whole_and_mapped
    assert input_device(mapped) == output_device(mapped) == torch.device("cpu")
    n = whole.config.num_hidden_layers
    spec = CaptureSpec((2, 4, 5), n, target_top=True)
    batch = samples([5, 9, 17, 30])
    want, got = (capture_shard(HfCapturer(m, spec, 40), batch, spec) for m in (whole, mapped))
    fields = {"input_ids", "loss_mask", "offsets", "aux_hidden", "final_hidden", "target_top"}
    assert set(got) == set(want) == fields
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # online: the training loop's capture of a collated batch
    ids = [s.input_ids for s in batch]
    padded = pad_batch(ids, "cpu")
    keep = (torch.arange(padded.shape[1])[None] < torch.tensor([len(s) for s in ids])[:, None]).long()
    collated = {"input_ids": padded, "attention_mask": keep}
    want, got = (checked_capture(m, spec, collated) for m in (whole, mapped))
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("device_map", ["everywhere", {"model.embed_tokens": "gpu"}, {}, ["cpu"], 0])
def test_a_bad_device_map_is_one_line_naming_it(device_map):
    with pytest.raises(UserError, match=r"^target\.device_map=.*: expected null, one of auto, bal") as err:
        TargetConfig(device_map=device_map)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "device_map, says",
    [
        ({"model.embed_tokens": "cpu", "lm_head": "cpu"}, "no device for model.layers.0."),
        ({"model.embed_tokens": "cpu", "model.feet": "cpu"}, "the target has no module 'model.feet'"),
        ({"model.embed_tokens": "cuda:99"}, "'model.embed_tokens' is put on cuda:99, and this machine has"),
    ],
)
def test_a_map_the_target_cannot_take_is_refused_before_its_weights_load(tiny_llama_dir, device_map, says):
    """transformers would load the first two without a word (what no entry names on the CPU)."""
    with pytest.raises(UserError, match=r"^target\.device_map=\{'model\.embed_tokens'") as err:
        target(tiny_llama_dir, device_map).load_model()
    assert says in str(err.value) and "\n" not in str(err.value)


def test_what_decodes_or_runs_several_processes_refuses_a_map(tiny_llama_dir, tmp_path, monkeypatch):
    """Regeneration's engine (the default backend), decoded validation, the evaluator, Medusa-2
    joint training and torchrun: each refused in one line naming the map and the way out, before
    any weights load."""
    mapped = TargetConfig(name_or_path=str(tiny_llama_dir), device_map="balanced")
    refused = r"^target\.device_map=balanced: "
    with pytest.raises(UserError, match=refused + r"regeneration's hf engine .*backend=server"):
        check_source(RootConfig(target=mapped))
    with pytest.raises(UserError, match=refused + r"decoded validation .*val_decode_prompts=0"):
        RootConfig(target=mapped, optim=OptimConfig(val_decode_prompts=2))
    with pytest.raises(UserError, match=refused + r"Medusa-2 joint training"):
        RootConfig(target=mapped, head=MedusaConfig(joint=True))
    with pytest.raises(UserError, match=refused + r"the evaluator's speculative decoder"):
        evaluate(RootConfig(target=mapped), tmp_path / "no-head", tmp_path / "eval")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=refused + r"one process .* 2 processes"):
        resolve_target(RootConfig(target=mapped))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a node with 2 or more GPUs")
def test_balanced_over_the_gpus_captures_what_one_gpu_does(tiny_llama_dir):
    """The split that matters (run it on a node of 2+ GPUs): layers on several GPUs,
    activations crossing them; offline fields, and online ones on the batch's device (cuda:0)."""
    one = resolve_target(RootConfig(target=TargetConfig(name_or_path=str(tiny_llama_dir), device="cuda:0",
                                                        dtype="float32"))).load_model()
    split = resolve_target(RootConfig(target=TargetConfig(name_or_path=str(tiny_llama_dir), dtype="float32",
                                                          device_map="balanced"))).load_model()
    assert len({p.device for p in split.parameters()}) >= 2
    spec = CaptureSpec((2, 4, 5), one.config.num_hidden_layers, target_top=True)
    batch = samples([5, 9, 17, 30])
    want, got = (capture_shard(HfCapturer(m, spec, 40), batch, spec) for m in (one, split))
    for name in want:
        assert torch.allclose(got[name].float(), want[name].float(), atol=1e-2, rtol=2**-7), name
    ids = pad_batch([s.input_ids for s in batch], "cuda:0")
    collated = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    want, got = (checked_capture(m, spec, collated) for m in (one, split))
    for name in want:
        assert got[name].device == ids.device, name
        assert torch.allclose(got[name].float(), want[name].float(), atol=1e-2, rtol=2**-7), name
