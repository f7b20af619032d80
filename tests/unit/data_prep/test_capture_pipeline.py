"""Offline capture that keeps the GPU busy, held to the serial path it replaced.

- `exactly_causal`: the rule for leaving the mask to transformers (flash/SDPA causal kernels).
- the hooks keep exactly the layers `output_hidden_states` gives, and stop the forward after the
  last one a capture needs;
- a folder captured by the pipelined path (hooks, encode on the device, host copy, a writer
  thread that hashes while it writes) is byte for byte the folder of the serial path of HEAD
  6058c73 (every hidden state, a 4D mask, float32 per sample to the host, encode there,
  `save_file`, then `sha256_file` reading the shard back), which this module re-states.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from conf.files import atomic_write, sha256_file
from data_prep.folders.store import capture_shards, open_partial, shard_name
from data_prep.states.capture import (
    TOP,
    CaptureSpec,
    attention_masks,
    causal_mask,
    encode,
    exactly_causal,
    hidden_states,
    kept_fields,
    length_batches,
    pad_batch,
    with_top,
)
from data_prep.template import Tokenized

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize(
    "family, settings, packed, exact",
    [
        ("llama", {}, False, True),
        ("llama", {}, True, False),  # packed documents need their own masks
        ("mistral", {"sliding_window": 16}, False, False),
        ("gemma3_text", {"sliding_window": 16}, False, False),  # sliding and full layers
        ("qwen2", {"use_sliding_window": False}, False, True),
    ],
)
def test_exactly_causal_only_for_one_sample_rows_without_windows(family, settings, packed, exact):
    config = AutoConfig.for_model(family, num_hidden_layers=2, **settings)
    config._attn_implementation = "sdpa"
    assert exactly_causal(config, packed) is exact


def test_flash_attention_is_never_called_exact():
    """`attention_masks` refuses it in one line; the rule must not route around that check."""
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    config._attn_implementation = "flash_attention_2"
    assert not exactly_causal(config, packed=False)


def reference_layers(model, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every hidden state as HEAD's capture asked for them: `output_hidden_states`, a 4D mask."""
    width = ids.shape[1]
    positions = torch.arange(width)[None]
    mask = attention_masks(model.config, causal_mask(width, ids.device), positions, model.dtype)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
                    logits_to_keep=1)
    return out.hidden_states


def test_hooks_keep_the_layers_of_output_hidden_states_and_stop_after_the_last(tiny_model):
    n = tiny_model.config.num_hidden_layers
    ids = torch.randint(3, 200, (2, 9))
    every = reference_layers(tiny_model, ids)
    for spec in (CaptureSpec((1, n // 2, n - 1), n, target_top=True), CaptureSpec((0, 1), None)):
        got = hidden_states(tiny_model, ids, spec)
        want = kept_fields(every, spec, ids.device)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ran: list[str] = []
    watched = [*tiny_model.get_decoder().layers, tiny_model.get_output_embeddings()]
    hooks = [m.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, m in enumerate(watched)]
    try:
        hidden_states(tiny_model, ids, CaptureSpec((0, 1), None))  # layer 1 = after decoder layer 0
    finally:
        for h in hooks:
            h.remove()
    assert ran == [0]  # neither the later layers nor the lm_head ran


def serial_shard(model, chunk: list[Tokenized], spec: CaptureSpec, batch_tokens: int
                 ) -> dict[str, torch.Tensor]:
    """HEAD 6058c73's `capture_shard` over `HfCapturer`: per batch every hidden state under a 4D
    mask, each sample's fields in float32 to the host, encoded there."""
    lengths = [len(s.input_ids) for s in chunk]
    parts: dict[str, list[torch.Tensor]] = {}
    for idx in length_batches(lengths, batch_tokens):
        batch = [chunk[i].input_ids for i in idx]
        every = reference_layers(model, pad_batch(batch, "cpu"))
        fields = with_top(kept_fields(every, spec, torch.device("cpu")), spec, model.get_output_embeddings())
        for b, s in enumerate(batch):
            for name, v in fields.items():
                row = v[b, : len(s)]
                groups = spec.groups(name)
                stored = {TOP: row} if name == TOP else encode(name, row.float(), groups, spec.storage_dtype)
                for k, x in stored.items():
                    parts.setdefault(k, []).append(x)
    return {
        "input_ids": torch.tensor([t for s in chunk for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in chunk for m in s.loss_mask], dtype=torch.bool),
        "offsets": torch.tensor([0] + lengths).cumsum(0),
    } | {k: torch.cat(v) for k, v in parts.items()}


def serial_split(partial, split: str, chunks, spec, model, batch_tokens: int) -> list[dict]:
    """HEAD 6058c73's `write_split`: `save_file`, then the shard read back to count and hash it."""
    (partial / split).mkdir()
    records = []
    for i, chunk in enumerate(chunks):
        path = partial / split / shard_name(i)
        tensors = serial_shard(model, chunk, spec, batch_tokens)
        meta = {"uids": json.dumps([s.uid for s in chunk])}
        atomic_write(path, lambda p, t=tensors, m=meta: save_file(t, str(p), metadata=m))
        records.append({
            "file": f"{split}/{path.name}", "samples": len(chunk), "tokens": int(tensors["offsets"][-1]),
            "masked_tokens": int(tensors["loss_mask"].sum()), "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        })
    return records


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
@pytest.mark.parametrize("keeps", ["aux_final_top", "aux_only"])
def test_pipelined_folder_is_the_serial_folder_byte_for_byte(tiny_model, tmp_path, storage, keeps):
    n = tiny_model.config.num_hidden_layers
    spec = (CaptureSpec((1, n // 2, n - 1), n, storage, target_top=True) if keeps == "aux_final_top"
            else CaptureSpec((1, 2), None, storage))
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(11):  # lengths sorted as prepare shards them; several batches per shard
        ids = torch.randint(3, 200, (3 + 2 * i,), generator=gen).tolist()
        samples.append(Tokenized(ids, [j % 3 != 0 for j in range(len(ids))], False, f"uid-{i}"))
    chunks, batch_tokens = [samples[:6], samples[6:]], 40
    new = open_partial(tmp_path / "new", {"plan": 1})
    records = capture_shards(tiny_model, spec, chunks, new, batch_tokens)  # the GPU check's unit
    old = open_partial(tmp_path / "old", {"plan": 1})
    assert records == serial_split(old, "train", chunks, spec, tiny_model, batch_tokens)
    for r in records:
        assert (new / r["file"]).read_bytes() == (old / r["file"]).read_bytes(), r["file"]
