"""The regeneration engine: continuous batching over a static per-slot KV cache must write what
`model.generate` writes (greedy, token for token), and a sampled answer must depend on its prompt
and seed alone, not on the batch, slot or order it ran in."""

from __future__ import annotations

import shutil

import pytest
import torch

from data_prep.answers import decode_attention, regen_engine
from data_prep.answers.regen_engine import generate, noise_size, shared_prefix, top_p_filter, two_level_race
from data_prep.linears import DataLinears, can_pack, native_bf16, resolve_matmul_dtype
from tests.support.targets import chat, hf_greedy, until


@pytest.mark.parametrize("chaotic", ["llama"], indirect=True)
def test_greedy_matches_generate_with_refills_and_early_eos(chaotic):
    """Batching, refills, early stops and bf16 GEMMs on the llama target alone: none of it differs
    by family. What does (Qwen2's biased q/k/v, packed and in bf16) is each engine test below on
    both, and the engine on every family is tests/e2e/test_target_families.py's."""
    model, tok = chaotic
    prompts, new = chat(tok, 32), 24
    assert shared_prefix(prompts) > 10  # the chat header: prefilled once and copied into each slot
    full = [hf_greedy(model, p, new) for p in prompts]
    # EOS ids taken from the references at varied steps, so answers end anywhere from the first
    # token (decided at prefill) to max_new_tokens, and slots free up at different steps.
    eos = {full[i][(7 * i) % new] for i in range(0, 32, 3)}
    want = [until(f, eos) for f in full]
    # Answers of every length, one that is its stop token alone among them.
    assert len({len(w) for w in want}) >= 6 and min(map(len, want)) == 1 and max(map(len, want)) == new

    for workers, batch_size in ((1, 5), (2, 10)):  # two engines side by side, 5 rows each
        finished: list[tuple[int, list[int]]] = []
        got = generate(
            model,
            prompts,
            max_new_tokens=new,
            batch_size=batch_size,
            eos_token_ids=eos,
            on_finish=lambda i, ids, finished=finished: finished.append((i, list(ids))),
            prefill_tokens=150,  # small prefill groups: several prefill forwards per refill
            workers=workers,
        )
        assert got == want
        assert sorted(finished) == sorted(enumerate(want))
        assert [i for i, _ in finished] != sorted(i for i, _ in finished)  # streamed as they finish

    # With bf16 GEMMs (data.matmul_dtype) the engine writes what `model.generate` writes with the
    # same linear layers, but for near ties: a linear's input rounded to bf16 turns float32 noise
    # (attention over another width, GEMMs of another row count) into a bf16 step now and then.
    with DataLinears(model, torch.bfloat16):
        want = [until(hf_greedy(model, p, new), eos) for p in prompts]
    assert sum(w != until(f, eos) for w, f in zip(want, full)) >= 16  # not float32's precision
    # Two engines side by side, as above: the one-worker engine's batching is float32's above.
    got = generate(
        model, prompts, max_new_tokens=new, batch_size=10, eos_token_ids=eos,
        prefill_tokens=150, workers=2, matmul_dtype=torch.bfloat16,
    )
    assert not any("forward" in vars(m) for m in model.modules())
    # 29/32 here (tiny Llama; 32/32 on Qwen2), against 5/32 equal to the float32 answers.
    assert sum(g == w for g, w in zip(got, want)) >= 24


def test_slots_shrink_to_the_free_memory_and_write_the_same(chaotic, monkeypatch):
    """Long prompts on a small machine: an engine keeps the slots whose caches fit (the host's
    free memory stands in here as a small number), and writes what it writes with all of them."""
    model, tok = chaotic
    prompts, new = chat(tok, 8, seed=5), 10
    want = generate(model, prompts, max_new_tokens=new, batch_size=8, eos_token_ids=[])
    longest = max(map(len, prompts)) + new
    per_token = regen_engine.slot_bytes_per_token(model.config, model.dtype, 0)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    assert per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    made, init = [], regen_engine.SlotCache.__init__

    def counted(self, slots, *args):
        made.append(slots)
        init(self, slots, *args)

    monkeypatch.setattr(regen_engine.SlotCache, "__init__", counted)
    free = int(3 * longest * per_token / regen_engine.CACHE_SHARE)  # three slots' caches
    monkeypatch.setattr(regen_engine, "free_bytes", lambda device: free)
    assert generate(model, prompts, max_new_tokens=new, batch_size=8, eos_token_ids=[]) == want
    assert made == [3 + 1]  # and the shared prefix's spare slot
    assert regen_engine.slots_that_fit(8, longest, per_token, 0) == 1  # one row always runs


def test_engine_without_a_compiler_writes_the_same_on_pytorch_attention(chaotic, monkeypatch):
    model, tok = chaotic
    prompts, new = chat(tok, 8, seed=3), 12
    want = [hf_greedy(model, p, new) for p in prompts]
    # Where a compiler is (CI), every engine test above ran its decode steps on the kernel.
    assert decode_attention.applies(model) == (shutil.which("cc") is not None)
    monkeypatch.setenv("CC", "no-such-compiler")
    decode_attention.kernel.cache_clear()
    try:
        assert not decode_attention.applies(model)
        assert generate(model, prompts, max_new_tokens=new, batch_size=3, eos_token_ids=[]) == want
    finally:
        monkeypatch.undo()
        decode_attention.kernel.cache_clear()


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    return model, tok


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_answer_depends_on_its_seed_alone(tiny, temperature, top_p):
    model, tok = tiny
    prompts, seeds = chat(tok, 12, seed=1), list(range(100, 112))
    # One id in 16 ends an answer: rows end at random steps, so slots are refilled and compacted.
    common = dict(
        max_new_tokens=16,
        eos_token_ids=set(range(0, model.config.vocab_size, 16)),
        temperature=temperature,
        top_p=top_p,
    )
    first = generate(model, prompts, batch_size=12, seeds=seeds, **common)
    assert len({len(a) for a in first}) > 2

    assert generate(model, prompts, batch_size=12, seeds=seeds, **common) == first
    backwards = generate(model, prompts[::-1], batch_size=5, seeds=seeds[::-1], **common)
    assert backwards[::-1] == first
    alone = [generate(model, [p], batch_size=1, seeds=[s], **common)[0] for p, s in zip(prompts, seeds)]
    assert alone == first
    assert generate(model, prompts, batch_size=6, seeds=seeds, workers=3, **common) == first

    others = generate(model, prompts, batch_size=12, seeds=[s + 1000 for s in seeds], **common)
    assert sum(a != b for a, b in zip(first, others)) >= 10
    greedy = generate(model, prompts, batch_size=12, **{**common, "temperature": 0.0})
    assert sum(a != b for a, b in zip(first, greedy)) >= 10


def test_sampler_draws_from_the_nucleus_in_proportion():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.25, 0.05, 0.12, 0.08])
    nucleus = top_p_filter(probs[None], top_p=0.75)[0]
    # 0.3, 0.25 and 0.15 hold 0.7 < 0.75, so 0.12 joins them; nothing less likely does.
    assert nucleus.tolist() == pytest.approx([0, 0.3, 0, 0.15, 0.25, 0, 0.12, 0])
    # With 3 candidates, the peaked row's nucleus is among them and the flat row's is not (its
    # row is sorted in full): both come out as when every row is sorted.
    peaked = torch.tensor([0.02, 0.02, 0.9, 0.02, 0.01, 0.01, 0.01, 0.01])
    both = top_p_filter(torch.stack([probs, peaked]), top_p=0.75, candidates=3)
    assert torch.equal(both[0], nucleus) and both[1].tolist() == pytest.approx([0, 0, 0.9, 0, 0, 0, 0, 0])

    n = 40_000
    g = torch.Generator().manual_seed(0)
    noise = torch.empty(n, noise_size(len(probs))).exponential_(generator=g)
    counts = torch.bincount(two_level_race(nucleus.expand(n, -1), noise), minlength=len(probs))
    assert counts[[0, 2, 5, 7]].tolist() == [0, 0, 0, 0]
    assert (counts / n).tolist() == pytest.approx((nucleus / nucleus.sum()).tolist(), abs=0.01)


def test_shared_prefix_stops_short_of_the_shortest_prompt():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shortest prompt's last token is prefilled
    assert shared_prefix([[7, 2], [1, 2]]) == 0


def test_packed_linears_compute_the_same_and_leave_the_model_as_it_was(chaotic):
    model, _ = chaotic
    assert can_pack(model)  # CPU float32: the engine's decode steps take the packed path
    ids = torch.randint(0, model.config.vocab_size, (6, 1))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
        with DataLinears(model, rows=6):
            assert "forward" in vars(model.lm_head)
            packed = model(input_ids=ids).logits
            other_rows = model(input_ids=ids[:4]).logits  # not the packed row count: plain kernel
        assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other_rows, plain[:4], rtol=1e-5, atol=1e-5)


def test_bf16_linears_round_inputs_and_weights_and_hand_float32_back(chaotic):
    model, _ = chaotic
    linear = model.lm_head
    x = torch.randn(5, linear.in_features)
    rounded = x.bfloat16().float() @ linear.weight.detach().bfloat16().float().T  # exact products
    linears = DataLinears(model, torch.bfloat16, rows=5)  # bf16 wins over packing
    with torch.inference_mode():
        plain = linear(x)
        for _ in range(2):  # the weights are converted once; the block can be entered again
            with linears:
                got = linear(x)
            assert "forward" not in vars(linear)
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # a bf16 GEMM's output
    torch.testing.assert_close(got, rounded, rtol=2**-7, atol=1e-4)
    assert not torch.equal(got, plain)
    assert len(DataLinears(model, torch.float32).forwards) == 0  # the model's own dtype: nothing to do


def test_matmul_dtype_auto_takes_bf16_gemms_only_on_a_float32_cpu_target_with_native_bf16():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    native = torch.bfloat16 if native_bf16() else torch.float32
    assert resolve_matmul_dtype("auto", torch.float32, cpu) == native
    assert resolve_matmul_dtype("auto", torch.bfloat16, gpu) == torch.bfloat16
    assert resolve_matmul_dtype("auto", torch.float32, gpu) == torch.float32
    assert resolve_matmul_dtype("target", torch.float32, cpu) == torch.float32
    assert resolve_matmul_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16


def test_bf16_values_in_the_cache_write_the_answers_of_float32_values(chaotic, monkeypatch):
    """With bf16 linears a value leaves its projection as a bf16 number, so the engine caches
    values in bf16 (half the bytes its decode steps read on the kernel): the answers are those
    of a float32 value cache, token for token."""
    model, tok = chaotic
    prompts, new = chat(tok, 12, seed=5), 16
    kwargs = dict(max_new_tokens=new, batch_size=6, eos_token_ids=[], workers=2, matmul_dtype=torch.bfloat16)
    stored = []
    original = regen_engine.SlotCache

    class Recorded(original):
        def __init__(self, slots, max_len, value_dtype=None):
            stored.append(value_dtype)
            super().__init__(slots, max_len, value_dtype)

    class Float32Values(original):
        def __init__(self, slots, max_len, value_dtype=None):
            super().__init__(slots, max_len, None)

    monkeypatch.setattr(regen_engine, "SlotCache", Recorded)
    got = generate(model, prompts, **kwargs)
    bf16 = decode_attention.applies(model)  # the kernel reads bf16 values; PyTorch's keeps float32
    assert stored == [torch.bfloat16 if bf16 else None] * 2
    monkeypatch.setattr(regen_engine, "SlotCache", Float32Values)
    assert generate(model, prompts, **kwargs) == got
