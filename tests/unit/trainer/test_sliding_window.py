"""Targets whose layers attend over a sliding window write, in draftsmith's engine and decoder,
what transformers' own `generate` writes, token for token, long past the window: Mistral (every
layer slides), Gemma 3 (three sliding layers to one global, a rope of each kind) and gpt-oss
(sliding and full layers alternate, attention sinks, experts), float32, 16-token windows. The
regeneration engine (slot cache, shared prefix, refills, its decode kernel or PyTorch's
attention), plain greedy decoding and speculative decoding (a partly right drafter, chains and
trees; EAGLE-3's and Medusa's past the window: tests/e2e/test_target_families.py) are each
compared with `generate`; a full-attention target reads the
very mask it read before; a decoder that ignored the window would be caught; and a target whose
layers the static caches cannot mask is refused in one line before any weights load."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Gemma3TextConfig, Qwen2Config, Qwen3NextConfig

from conf.compose import compose_root
from conf.errors import UserError
from conf.schema import RootConfig, TargetConfig
from data_prep.answers import decode_attention
from data_prep.answers.regen_engine import generate
from data_prep.masks import AttentionLayout, attention_layout
from data_prep.target import resolve_target
from tests.support.decode import SHAPES, NoisyOracle
from tests.support.runs import tiny_run_args
from tests.support.targets import TINY, WINDOW, F, S, hf_greedy, tiny_family_target
from trainer.decoding import greedy_generate, kv_cache, speculative_generate
from trainer.decoding.kv_cache import TargetKV, causal, slot_positions
from trainer.decoding.tree import tree_attention_mask, tree_position_ids
from trainer.train import run

pytestmark = pytest.mark.usefixtures("single_thread")
NEW, VOCAB = 72, 256
# The tiny targets of support/targets.py's `TINY_FAMILIES` (8 layers, hidden 64, 16-token windows).
FAMILIES = ["mistral", "gemma3_text", "gpt_oss", "llama"]  # llama: full attention, nothing changes
SLIDING = ["mistral", "gemma3_text", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """(family, model, prompts, generate's answers). The prompts share a 20-token header, longer
    than the window (the engine prefills it once and copies it into each slot), then run 3 to 60
    tokens more; 72 new tokens take every answer far past the window."""
    model = tiny_family_target(request.param)
    g = torch.Generator().manual_seed(0)
    header = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    prompts = [header + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 60, 11, 42)]
    want = [hf_greedy(model, p, NEW) for p in prompts]
    assert len(set(want[0])) >= 20  # varied text: a wrong mask shows within a few tokens
    return request.param, model, prompts, want


def test_layouts_are_read_as_transformers_reads_them():
    layout = lambda family: attention_layout(tiny_family_target(family).config)  # noqa: E731
    assert layout("mistral").windows == (WINDOW,) * 8
    assert layout("gemma3_text").windows == (WINDOW, WINDOW, WINDOW, None) * 2
    assert layout("gpt_oss").windows == (WINDOW, None) * 4
    assert layout("llama").windows == (None,) * 8
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert attention_layout(qwen2).windows == (None, None, 8, 8)  # layers past max_window_layers
    # One mask for a uniform target (a Mistral reads no other), one per layer type otherwise.
    keep, distance = causal(3)[None, None], torch.arange(3)[:, None] - torch.arange(3)
    for windows, kind in (((2,) * 4, torch.Tensor), ((2, None) * 2, dict), ((None,) * 4, torch.Tensor)):
        mixed = AttentionLayout(windows)
        assert isinstance(mixed.argument(mixed.masks(keep, distance, torch.float32)), kind)
    both = AttentionLayout((2, None))
    masks = both.argument(both.masks(keep, distance, torch.float32))
    assert masks.keys() == {S, F}
    assert (masks[S][0, 0] == 0).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]  # 2 positions back
    assert (masks[F][0, 0] == 0).tolist() == causal(3).tolist()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch-attention"])
def test_engine_writes_what_generate_writes_past_the_window(case, kernel, monkeypatch):
    family, model, prompts, want = case
    windows = []
    if kernel:  # record the window each decode-kernel call ran with
        run_kernel = decode_attention.decode_attention

        def spy(*args, **kwargs):
            windows.append(args[-1] if len(args) > 5 else kwargs.get("window"))
            return run_kernel(*args, **kwargs)

        monkeypatch.setattr(decode_attention, "decode_attention", spy)
    else:
        monkeypatch.setattr(decode_attention, "applies", lambda model: False)
    # 2 slots for 4 prompts: refills into freed slots, prefills copying the shared header; the
    # first prefill pads the 62-token prompt to 80, so padding queries see nothing in their window.
    got = generate(model, prompts, max_new_tokens=NEW, batch_size=2, eos_token_ids=[], prefill_tokens=256)
    assert got == want
    if kernel and decode_attention.applies(model):  # a compiler at hand; gpt-oss runs eager
        assert set(windows) == set(attention_layout(model.config).windows)


@pytest.mark.parametrize("case", SLIDING, indirect=True)
def test_decoder_writes_what_generate_writes_past_the_window(case):
    """Plain greedy decoding on every prompt, and speculative decoding with a partly right drafter
    (its accepted paths cross the window edge): the chain on the short prompt, the tree on the
    long one. The sliding families only, this drafter only: EAGLE-3's and Medusa's drafters past
    the window on these families (every kind, trained; chains and trees) are
    tests/e2e/test_target_families.py's, a full-attention target's decoders test_decode_greedy.py's."""
    family, model, prompts, want = case
    for prompt, answer in zip(prompts, want):
        assert greedy_generate(model, torch.tensor(prompt), NEW).tokens == answer
    for shape, prompt, answer in zip(SHAPES, prompts, want):
        got = speculative_generate(model, NoisyOracle(model), torch.tensor(prompt), NEW, shape).tokens
        assert got == answer, (family, shape)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_decoder_blind_to_the_window_would_be_caught(family, monkeypatch):
    """The comparison is sharp: static caches that masked every layer as full attention (the
    fault this suite guards against) part from `generate` within a few tokens."""
    model = tiny_family_target(family)
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(kv_cache, "attention_layout", lambda config: AttentionLayout((None,) * 8))
    blind = greedy_generate(model, torch.tensor(prompt), NEW).tokens
    want = hf_greedy(model, prompt, NEW)
    assert blind != want and next(i for i, (a, b) in enumerate(zip(blind, want)) if a != b) < 8


def test_a_full_attention_target_reads_the_mask_it_always_read():
    model = tiny_family_target("llama")
    kv = TargetKV(model, [], room=40)
    kv.prefill(torch.arange(30))
    parents = [-1, 0, 0, 1]
    local, positions = tree_attention_mask(parents), tree_position_ids(parents, 30)
    distance = positions[:, None] - slot_positions(30, positions, kv.cache.capacity)[None]
    masks = kv.layout.masks(kv.cache.keep(local, 30), distance, model.dtype)
    assert kv.layout.kinds == (None,)
    assert torch.equal(kv.layout.argument(masks), kv.cache.mask(local, 30, model.dtype))


def config_only(folder, config) -> str:
    """A target folder holding a config and nothing else: loading weights from it would fail."""
    config.save_pretrained(folder)
    return str(folder)


def config_of(folder: str):
    """The config a run's `Target` reads from `folder`: what it checks before any weights load."""
    return resolve_target(RootConfig(target=TargetConfig(name_or_path=folder))).config


def test_a_target_the_caches_cannot_mask_is_refused_in_one_line_before_any_weights(
    tmp_path, chat_file, capsys
):
    linear = Qwen3NextConfig(num_hidden_layers=4, vocab_size=VOCAB)  # 3 of 4 layers linear attention
    folder = config_only(tmp_path / "qwen3-next", linear)
    with pytest.raises(UserError, match=r"qwen3_next\): 3 of its 4 layers are linear_attention") as err:
        attention_layout(config_of(folder))
    assert "\n" not in str(err.value)
    # The engine and the decoder refuse it too, before they touch the model.
    with pytest.raises(UserError, match="linear_attention"):
        generate(types.SimpleNamespace(config=linear), [[1, 2]], max_new_tokens=2, batch_size=1,
                 eos_token_ids=[])
    mixed = Gemma3TextConfig(**TINY, vocab_size=VOCAB, sliding_window=WINDOW, layer_types=[S, F] * 4)
    layout = attention_layout(config_of(config_only(tmp_path / "g3", mixed)))
    assert layout.windows == (WINDOW, None) * 4
    # A training run that would regenerate with the engine refuses it before loading the target;
    # one that decodes nothing goes on to its data stage (and fails there: the folder holds a
    # config alone, no tokenizer): decoded validation left to its default goes off in one line,
    # asked for it is refused.
    args = tiny_run_args("eagle3", tmp_path / "qwen3-next", chat_file, tmp_path / "run")
    with pytest.raises(UserError, match="no chat template"):
        run(compose_root(args))
    assert capsys.readouterr().out.startswith(
        "decoded validation off (target (qwen3_next): 3 of its 4 layers are linear_attention, which ")
    with pytest.raises(UserError, match="linear_attention"):
        run(compose_root([*args, "optim.val_decode_prompts=2"]))
    regenerating = [a for a in args if a != "data.regenerate.enabled=false"]  # on the hf engine
    with pytest.raises(UserError, match="linear_attention"):
        run(compose_root(regenerating))
