"""Run the frozen target over tokenized samples and keep the hidden states a head trains on.

One forward per length-grouped batch gives the layers' residual streams a head keeps (forward
hooks on those layers, the forward stopped after the last: `recorded_layers`; the project's one
layer convention is transformers' `hidden_states` numbering: index k = after k decoder layers,
N = after the final norm). EAGLE-3 keeps three of them concatenated, Medusa the final
one, Medusa-2 joint training none (it runs the target itself). Storage is bf16, or fp8 e4m3 with
one scale per token and layer, which halves the bytes at ~2-3 significant bits of loss.

Online training (`data.hidden_states=online`) stores none of it: the training loop runs the same
forward on each batch (`capture_batch`) and rounds through the storage dtype, so the objective
gets the very batch it would have read from disk.

A head trained against the target's distribution over a draft vocabulary (EAGLE-3) also needs the
target's own choice at each position (is it inside the draft vocabulary? did the draft pick it?),
which takes the full-vocabulary lm_head. Capture computes it once, from the final hidden state as
stored (so it is the argmax of the very logits the teacher reads), through the target's lm_head as
it computes in data prep (`data.matmul_dtype`), and keeps it as `TOP` (int32 per token,
`CaptureSpec.target_top`; online, the loop's capture computes it alike on each batch). Training
then multiplies the stored final hidden state by the draft vocabulary's rows of the lm_head only
(`trainer.kinds.eagle3.draft_teacher`): at the default 8,192 a sixth of SmolLM2's 49,152 rows,
where every epoch multiplied by all of them before.

What each mode costs. Offline keeps (aux layers + 1) x hidden size x 2 bytes per token in bf16,
plus 4 for the target's choice where kept and 5 for the ids and the loss mask; online keeps the
ids, masks and offsets (~5 bytes per token) plus the draft vocabulary's `d2t`/`t2d` (~115 KB), and
every rank runs its own frozen replica of the target on every training and validation batch (no
grad, the target's dtype, this module's code and layer ids, rounded through `data.storage_dtype`).
The head then gets its batch bit for bit where capture and training pad a batch alike, else up to
the bf16 rounding of about one value in 10^5 (float32 attention reduces over differently blocked
keys), so losses agree to ~1e-4 of their value (tests/unit/trainer/test_online.py). The replica
lives outside the DDP/ZeRO wrap: not in the optimizer, not sharded or all-reduced, not in
checkpoints; resume is exact in both modes. At 8B (32 KiB per token offline), 50k regenerated
conversations of ~1k tokens are 1.6 TB offline and 250 MB online, and the 300k-500k conversations
that give acceptance lengths of 2.5-3 fit on no single node's disk. Offline pays the forward once:
it suits shards that fit comfortably and are reused (several runs, epochs or head variants on one
data set), or a GPU that cannot hold the target beside the head. Online suits data that does not
fit (any 7-8B target past a few thousand conversations), one-off runs, or a GPU that reading 32 KiB
per token would starve; it pays one target forward per token in every epoch, and each rank holds
the target (16 GB in bf16 at 8B). `scripts/bench_online.py` prints both training speeds and the
bare capture forward.

`data.hidden_states=auto` (`data_prep.prepare`) picks online when the estimated shards exceed half
of the free disk under the cache and says why in one line, else offline, into the very folder an
explicit `offline` builds. An explicit `offline` whose shards cannot fit refuses before capture
starts, in one line (needed, free, and `online` as the way out).

Both check every layer's hidden states for values that overflowed (fp16 targets do): offline
capture refuses the shard in one line naming the layer and the sample; online capture hands the
loop where it happened as a device tensor (`checked_capture`), which the loop reads only where
it reads the device anyway (`trainer.health`).

A target split over devices (`target.device_map`) captures alike: the ids go to its embedding's
device (`data_prep.target.input_device`), and the kept layers, which come out of the forward on
the devices of the layers that computed them, are moved to the caller's device (where its ids
or mask are: the CPU-bound shard writer, the training loop's device) before they are
concatenated. There each kept layer crosses devices once; gathering them on the lm_head's
device first would move them twice online.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from conf.errors import UserError
from data_prep.masks import attention_layout, check_masked
from data_prep.target import input_device
from data_prep.template import Tokenized

LAYER_CONVENTION = "hf_hidden_states"
# `checked_capture`'s extra field: int64 [3] (layer id, row, position) of the first non-finite
# hidden state of the batch, or -1s.
NONFINITE = "nonfinite_hidden"
# Bytes every shard holds per token whatever is captured: an int32 id and a bool loss mask.
TOKEN_BYTES = 5
# The field of the target's top-1 id at each position (int32), where `CaptureSpec.target_top`.
TOP = "target_top"
TOP_BYTES = 4
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass(frozen=True)
class CaptureSpec:
    """What to keep per token; empty `aux_layer_ids` and `final=False` = tokens only.
    `target_top`: also the target's top-1 id (`TOP`), from the final layer, which it needs."""

    aux_layer_ids: tuple[int, ...]
    final_layer_id: int | None
    storage_dtype: str = "bfloat16"  # one of conf.schema.STORAGE_DTYPES
    target_top: bool = False

    def __post_init__(self):
        if self.target_top and self.final_layer_id is None:
            raise ValueError("CaptureSpec: target_top is computed from the final layer; capture it")

    @property
    def layers(self) -> tuple[int, ...]:
        """The transformers `hidden_states` indices it reads: aux layers, then the final."""
        final = () if self.final_layer_id is None else (self.final_layer_id,)
        return (*self.aux_layer_ids, *final)

    @property
    def needs_forward(self) -> bool:
        return bool(self.aux_layer_ids) or self.final_layer_id is not None

    def groups(self, field: str) -> int:
        """Layers concatenated in a stored field (fp8 keeps one scale per token and layer)."""
        return len(self.aux_layer_ids) if field == "aux_hidden" else 1

    def bytes_per_token(self, hidden_size: int) -> int:
        """Stored bytes per token of what the forward gives: hidden states at 2 per value in bf16,
        1 plus a float32 scale per layer in fp8, and the target's choice (token ids and masks add
        `TOKEN_BYTES`)."""
        layers = len(self.aux_layer_ids) + (self.final_layer_id is not None)
        hidden = layers * (hidden_size + 4 if self.storage_dtype == "fp8" else 2 * hidden_size)
        return hidden + TOP_BYTES * self.target_top


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count * longest) stays within `batch_tokens`.

    Callers pass samples sorted by length, so consecutive groups waste little padding.
    """
    batches: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if batches and max(longest, n) * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
            longest = max(longest, n)
        else:
            batches.append([i])
            longest = n
    return batches


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G*H] float -> (fp8 [T, G*H], float32 scale [T, G]): one scale per token and layer."""
    t = x.shape[0]
    chunks = x.float().reshape(t, groups, -1)
    scale = (chunks.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (chunks / scale.unsqueeze(-1)).to(FP8)
    return q.reshape(t, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t, groups = scale.shape
    return (q.float().reshape(t, groups, -1) * scale.unsqueeze(-1)).reshape(t, -1)


def encode(name: str, x: torch.Tensor, groups: int, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Storage tensors for one hidden-state field: `name` (+ `name_scale` in fp8)."""
    if storage_dtype == "fp8":
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}
    return {name: x.to(torch.bfloat16)}


def decode(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Inverse of `encode`: float32 [T, G*H]."""
    scale = tensors.get(f"{name}_scale")
    return tensors[name].float() if scale is None else dequantize_fp8(tensors[name], scale)


def pad_batch(batch: list[list[int]], device) -> torch.Tensor:
    """Token ids [B, T], right-padded with 0 to the longest row."""
    width = max(len(ids) for ids in batch)
    return torch.tensor([s + [0] * (width - len(s)) for s in batch], device=device)


def causal_mask(width: int, device) -> torch.Tensor:
    """Bool [1, 1, T, T], ready-made for the model: the causal mask of right-padded rows.

    Under it no real position attends to a pad, so a padding mask would change nothing there.
    Handed over as 4D because with a 2D mask (or none) transformers reads the mask (or the
    position ids) back from the device to choose its attention path: a sync per forward, which
    online training runs every step. Offline capture leaves the mask to transformers where that
    is exact (`exactly_causal`), so that the target gets its causal kernels."""
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()[None, None]


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, 1, T, T]: causal attention inside each document of packed rows, a document
    starting wherever `position_ids` [B, T] restart at 0. Query t's document starts at
    t - position_ids[t], so the mask is built from the positions alone, at a fixed shape, on
    their device: no read-back. Padding (position 0) attends to itself only."""
    t = torch.arange(position_ids.shape[1], device=position_ids.device)
    keys = t[None, None, :]
    start = (t - position_ids)[:, :, None]
    return ((keys <= t[None, :, None]) & (keys >= start))[:, None]


def attention_masks(config, keep: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """The `attention_mask` a forward of `config`'s target takes, from `keep` (bool [B|1, 1, T, T],
    causal or per document) and `positions` [B|1, T]: additive 4D masks built as the regeneration
    engine and the decoder build theirs (`masks.AttentionLayout`), one per layer kind, a sliding
    layer's also hiding the keys past its window. A ready-made 4D mask is used as it is, so a
    bool one would give every sliding layer full attention (and eager attention, gpt-oss's,
    would add it as 0/1): the hidden states would not be those the target computes. A target
    with layers the layout cannot describe (linear attention) keeps `keep` as it is. An attention
    that reads no dense mask (flash) is refused in one line (`masks.check_masked`)."""
    check_masked(config._attn_implementation, "capture", "data.capture.backend=vllm")
    try:
        layout = attention_layout(config)
    except UserError:
        return keep
    distance = positions[:, None, :, None] - positions[:, None, None, :] if layout.sliding else None
    return layout.argument(layout.masks(keep, distance, dtype))


def document_inputs(model, position_ids: torch.Tensor) -> dict:
    """`model`'s keyword arguments for packed rows: each document is run as if alone (its own
    positions, no attention across documents, each sliding layer's window within it)."""
    mask = attention_masks(model.config, document_mask(position_ids), position_ids, model.dtype)
    return {"attention_mask": mask, "position_ids": position_ids}


def exactly_causal(config, packed: bool) -> bool:
    """Whether leaving the mask to transformers (`attention_mask` None) masks exactly as the
    ready-made causal mask (`causal_mask` through `attention_masks`) does: rows right-padded, one
    sample each (`packed` rows need their documents' masks), and every layer attending over every
    earlier position (a sliding window, or a layout `masks.attention_layout` cannot describe,
    takes the masks `attention_masks` builds; so does a flash attention, which it refuses). Under
    it no real position attends to a pad, and transformers runs the causal kernels (flash, SDPA's
    `is_causal`) instead of a dense [B, 1, T, T] mask. Without a mask transformers reads the
    positions back (to look for packed rows): one sync per forward, which offline capture pays at
    each batch's start and online training, whose steps never sync, does not."""
    if packed:
        return False
    try:
        return not attention_layout(config).sliding
    except UserError:
        return False


def attention_inputs(model, ids: torch.Tensor, position_ids: torch.Tensor | None,
                     may_sync: bool = False) -> dict:
    """`model`'s attention keyword arguments for right-padded ids [B, T] (packed rows if
    `position_ids` are given): none where `may_sync` and the mask is `exactly_causal`, else the
    ready-made 4D masks (no read-back)."""
    if position_ids is not None:
        return document_inputs(model, position_ids)
    if may_sync and exactly_causal(model.config, packed=False):
        return {}
    width = ids.shape[1]
    positions = torch.arange(width, device=ids.device)[None]
    mask = attention_masks(model.config, causal_mask(width, ids.device), positions, model.dtype)
    return {"attention_mask": mask}


class _Done(Exception):
    """Raised by the hook of the last layer a forward needs: the rest of the target (its later
    layers, the final norm, the lm_head) does not run."""


def nonfinite_rows(h: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: the positions of hidden states h [B, T, H] that hold a non-finite value."""
    return ~torch.isfinite(h).all(-1)


def recorded_layers(
    model, forward: Callable[[], Any], wanted: Sequence[int], verdicts_on: torch.device | None = None
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """Run `forward` (a call of `model`) and keep the layers `wanted` (transformers'
    `hidden_states` numbering: k = the input of decoder layer k, N = the decoder's output, after
    its final norm) through forward hooks on those layers, stopping the forward after the last
    one: only the kept layers stay alive, where `output_hidden_states` kept all N+1 (SpecForge's
    hf backend hooks its aux layers alike). With `verdicts_on`, also `nonfinite_rows` of every
    layer up to the last kept, on that device, lowest first (the layer to name is the first that
    overflows); the later layers do not run, so they cannot change what is stored."""
    decoder = model.get_decoder()
    blocks, last = decoder.layers, max(wanted)
    n = len(blocks)
    kept: dict[int, torch.Tensor] = {}
    verdicts: list[torch.Tensor] = []

    def record(index: int, h: torch.Tensor) -> None:
        if verdicts_on is not None:
            verdicts.append(nonfinite_rows(h).to(verdicts_on))
        if index in wanted:
            kept[index] = h
        if index == last:
            raise _Done

    def output(o) -> torch.Tensor:
        return o[0] if isinstance(o, tuple) else o

    hooks = [blocks[0].register_forward_pre_hook(
        lambda m, a, k: record(0, a[0] if a else k["hidden_states"]), with_kwargs=True)]
    hooks += [
        block.register_forward_hook(lambda m, a, o, i=i: record(i, output(o)))
        for i, block in enumerate(blocks[: min(last, n - 1)], start=1)
    ]
    if last == n:  # transformers' hidden_states[N] is the decoder's last_hidden_state
        final = lambda o: o[0] if isinstance(o, tuple) else o.last_hidden_state  # noqa: E731
        hooks.append(decoder.register_forward_hook(lambda m, a, o: record(n, final(o))))
    try:
        forward()
    except _Done:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return kept, verdicts


def kept_fields(hs: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], spec: CaptureSpec,
                device: torch.device) -> dict[str, torch.Tensor]:
    """The layers `spec` keeps as its fields, on `device` (a split target's layers sit on
    several); `hs[i]`: layer i in transformers' `hidden_states` numbering (every layer of a
    forward, or only the kept ones an engine gave, by id)."""
    out = {}
    if spec.aux_layer_ids:
        out["aux_hidden"] = torch.cat([hs[i].to(device) for i in spec.aux_layer_ids], dim=-1)
    if spec.final_layer_id is not None:
        out["final_hidden"] = hs[spec.final_layer_id].to(device)
    return out


def with_top(fields: dict[str, torch.Tensor], spec: CaptureSpec, lm_head: torch.nn.Module | None
             ) -> dict[str, torch.Tensor]:
    """`fields` with the target's top-1 (`TOP`) where `spec` keeps it, from the final state as
    stored: the logits the teacher reads (every capture path computes it so)."""
    if spec.target_top:
        fields[TOP] = greedy_ids(lm_head, stored(fields["final_hidden"], 1, spec.storage_dtype))
    return fields


def _forward(model, ids: torch.Tensor, position_ids: torch.Tensor | None, layers: Sequence[int],
             verdicts_on: torch.device | None = None, may_sync: bool = False
             ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """`recorded_layers` of one forward over right-padded ids [B, T] (packed rows if
    `position_ids` are given), the inputs moved to the target's input device first: the one
    forward of offline capture and online training."""
    at = input_device(model)
    ids, position_ids = ids.to(at), None if position_ids is None else position_ids.to(at)
    attention = attention_inputs(model, ids, position_ids, may_sync)
    # logits_to_keep=1: the lm_head over the whole vocabulary is never needed (the hooks stop
    # the forward before it anyway).
    run = lambda: model(input_ids=ids, **attention, use_cache=False, logits_to_keep=1)  # noqa: E731
    return recorded_layers(model, run, layers, verdicts_on)


@torch.inference_mode()
def hidden_states(
    model, ids: torch.Tensor, spec: CaptureSpec, position_ids: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The fields `spec` keeps for right-padded ids [B, T] (packed rows if `position_ids` are
    given), in the model's dtype on the device of `ids`: `aux_hidden` [B, T, 3H] and/or
    `final_hidden` [B, T, H]."""
    return kept_fields(_forward(model, ids, position_ids, spec.layers)[0], spec, ids.device)


# Logits one lm_head call of `greedy_ids` computes: ~256 MB in float32 whatever the vocabulary.
LOGIT_ELEMENTS = 1 << 26


@torch.no_grad()
def greedy_ids(lm_head: torch.nn.Module, final: torch.Tensor) -> torch.Tensor:
    """Int32 [...]: the target's top-1 id for each row of final hidden states `final` [..., H],
    the argmax of its `lm_head` (the module, so that it computes as the target's linears do in
    data prep; a final logit softcap or scale is monotonic and changes no argmax), on the device
    of `final`. Chunked so that full-vocabulary logits never all sit in memory."""
    weight = lm_head.weight
    flat = final.reshape(-1, final.shape[-1]).to(weight.device, weight.dtype)
    rows = max(1, LOGIT_ELEMENTS // weight.shape[0])
    tops = [lm_head(part).argmax(-1).int() for part in flat.split(rows)]
    return torch.cat(tops).reshape(final.shape[:-1]).to(final.device)


def first_flagged(bad: torch.Tensor) -> torch.Tensor:
    """Int64 [3] on `bad`'s device: (layer id, row, position) of the first True of bool
    [L, B, T] (lowest layer first), or -1s; computed without reading the device back."""
    _, b, t = bad.shape
    first = bad.flatten().long().argmax()  # the first True (argmax returns the first maximum)
    where = torch.stack([first // (b * t), first // t % b, first % t])
    return torch.where(bad.any(), where, -1)


def first_nonfinite(layers: Sequence[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """Int64 [3] on `keep`'s device: (layer id, row, position) of the first non-finite hidden
    state at a position `keep` [B, T] marks (lowest layer first: the one that overflowed, as every
    later layer inherits it), or -1s. Computed without reading the device back; of a split
    target's layers only the [B, T] verdicts cross devices."""
    return first_flagged(torch.stack([nonfinite_rows(h).to(keep.device) for h in layers]) & keep)


@torch.inference_mode()
def checked_hidden_states(
    model, ids: torch.Tensor, spec: CaptureSpec, keep: torch.Tensor, position_ids: torch.Tensor | None = None,
    may_sync: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`hidden_states` and `first_nonfinite` over every layer the forward ran (not only the kept
    ones: the layer to name is the first that overflows), both on `keep`'s device. `may_sync`:
    see `attention_inputs`."""
    kept, verdicts = _forward(model, ids, position_ids, spec.layers, keep.device, may_sync)
    return kept_fields(kept, spec, keep.device), first_flagged(torch.stack(verdicts) & keep)


def overflow_message(layer: int, position: int, sample: str) -> str:
    """One line for a non-finite hidden state of the target, offline and online alike."""
    return (
        f"the target's hidden states overflow: layer {layer} (HF hidden_states index, after "
        f"{layer} decoder layers) is non-finite at token {position} of {sample}; a float16 target "
        "overflows where bfloat16 and float32 do not: set target.dtype=bfloat16 (or float32)"
    )


@torch.inference_mode()
def batch_fields(model, batch: list[list[int]], spec: CaptureSpec
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One right-padded forward of offline capture (the mask left to transformers where that is
    exact: `exactly_causal`): the kept fields [B, T, ...] on the target's input device, `TOP`
    where kept, and where they overflowed (`first_flagged`'s int64 [3], not read back here)."""
    ids = pad_batch(batch, input_device(model))
    lengths = torch.tensor([len(s) for s in batch], device=ids.device)
    keep = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
    fields, where = checked_hidden_states(model, ids, spec, keep, may_sync=True)
    return with_top(fields, spec, model.get_output_embeddings()), where


def refuse_overflow(where: list[int], names: list[str]) -> None:
    """Refuse a batch whose hidden states are not finite (`where`: `first_flagged`'s, read
    back), naming the layer and the sample (`names`)."""
    layer, row, position = where
    if layer >= 0:
        raise UserError(overflow_message(layer, position, names[row]))


def forward_hidden(
    model, batch: list[list[int]], spec: CaptureSpec, names: list[str]
) -> list[dict[str, torch.Tensor]]:
    """One right-padded forward; per sample its fields [L, G*H] in float32 on the CPU (`TOP`
    [L] int32, where kept). Refuses a batch whose hidden states are not finite, naming the
    layer and the sample (`names`)."""
    fields, where = batch_fields(model, batch, spec)
    refuse_overflow(where.tolist(), names)
    return [
        {k: v[b, : len(s)].cpu() if k == TOP else v[b, : len(s)].float().cpu() for k, v in fields.items()}
        for b, s in enumerate(batch)
    ]


def encode_batch(fields: dict[str, torch.Tensor], spec: CaptureSpec) -> dict[str, torch.Tensor]:
    """Fields [B, T, ...] as a shard stores them (`encode`), on their device. `encode` works per
    token (fp8 keeps one scale per token and layer), so a sample's rows come out byte for byte as
    `capture_shard` encodes them from the sample's float32 fields; on a GPU the host then copies
    half the bytes (bf16) or a quarter (fp8), and encodes nothing itself."""
    out = {}
    for name, x in fields.items():
        if name == TOP:
            out[TOP] = x
            continue
        b, t = x.shape[:2]
        for k, v in encode(name, x.reshape(b * t, -1), spec.groups(name), spec.storage_dtype).items():
            out[k] = v.reshape(b, t, -1)
    return out


def host_copy(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """`tensors` (on one device) copied to the host without waiting for them: from a GPU into
    pinned buffers (PyTorch's caching host allocator, which reuses a buffer once its copy is
    done), asynchronously, with the CUDA event that marks the copies done; from the CPU as they
    are, no event. A copy from the GPU into pageable memory would wait for the forward instead."""
    device = next(iter(tensors.values())).device
    if device.type != "cuda":
        return {k: v.cpu() for k, v in tensors.items()}, None
    out = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
           for k, v in tensors.items()}
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return out, event


@dataclass
class HostBatch:
    """One batch of stored fields [B, T, ...] on its way to the host (`host_copy`), with
    `NONFINITE` among them, and its rows' lengths and names."""

    tensors: dict[str, torch.Tensor]
    event: Any
    lengths: list[int]
    names: list[str]

    def samples(self) -> Iterator[dict[str, torch.Tensor]]:
        """Once copied: refused if not finite (`refuse_overflow`), else each row's real tokens,
        copied out (so the batch's pinned buffers go back to the allocator at once)."""
        if self.event is not None:
            self.event.synchronize()
        tensors = dict(self.tensors)
        refuse_overflow(tensors.pop(NONFINITE).tolist(), self.names)
        for b, n in enumerate(self.lengths):
            yield {k: v[b, :n].clone() for k, v in tensors.items()}


@torch.inference_mode()
def launch_batch(model, batch: list[list[int]], spec: CaptureSpec, names: list[str]) -> HostBatch:
    """`batch_fields` encoded on the target's device (`encode_batch`) and sent to the host
    (`host_copy`), nothing waited for."""
    fields, where = batch_fields(model, batch, spec)
    tensors, event = host_copy(encode_batch(fields, spec) | {NONFINITE: where})
    return HostBatch(tensors, event, [len(s) for s in batch], names)


def stored(x: torch.Tensor, groups: int, storage_dtype: str) -> torch.Tensor:
    """`x` [..., G*H] as the offline path reads it back: encoded for storage, decoded to float32."""
    flat = x.reshape(-1, x.shape[-1])
    return decode(encode("x", flat, groups, storage_dtype), "x").reshape(x.shape)


def checked_capture(model, spec: CaptureSpec, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`capture_batch`'s fields plus NONFINITE, where the batch's hidden states first overflowed
    (a device tensor: the training step reads nothing back)."""
    keep = batch["attention_mask"].bool()
    fields, where = checked_hidden_states(model, batch["input_ids"], spec, keep, batch.get("position_ids"))
    out = {
        name: torch.where(keep[..., None], stored(x, spec.groups(name), spec.storage_dtype), 0)
        for name, x in fields.items()
    }
    if spec.target_top:  # zero on padding, as collate pads the stored field
        out[TOP] = torch.where(keep, greedy_ids(model.get_output_embeddings(), out["final_hidden"]), 0)
    return out | {NONFINITE: where.clone()}  # an ordinary tensor, out of inference mode


def capture_batch(model, spec: CaptureSpec, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Online mode's capture: the hidden-state fields of a collated batch on the batch's device,
    exactly as the offline path hands them to the objective (stored through `storage_dtype`,
    widened to float32, zero on padding as collate pads; packed rows as their documents alone).
    The forward runs in inference mode; the rounding outside it, so that the results are
    ordinary tensors autograd may save."""
    out = checked_capture(model, spec, batch)
    del out[NONFINITE]
    return out


def sample_name(sample: Tokenized, index: int) -> str:
    """A sample as an error names it: its uid when the spill recorded one."""
    uid = getattr(sample, "uid", "")
    return f"sample {uid!r}" if uid else f"sample {index} of the shard being captured"


class Capturer(Protocol):
    """A capture backend (`data.capture.backend`): the kept fields of every sample of a shard, in
    order, float32 [L, G*H] on the CPU (`TOP` int32 [L] where kept), as `forward_hidden` gives
    them. `names` name the samples in an error. The `hf` one is `HfCapturer`; the serving
    engine's are in `data_prep.states.capture_engine`. A backend that encodes on its device also has
    `encoded(samples, names)`: each sample as the shard stores it (`stored_sample`'s), which
    `capture_shard` takes instead."""

    def __call__(self, samples: list[list[int]], names: list[str]) -> Iterable[dict[str, torch.Tensor]]: ...


@dataclass
class HfCapturer:
    """`data.capture.backend=hf`: the transformers target in this process, one right-padded forward
    per length-grouped batch of at most `batch_tokens` padded tokens."""

    model: Any
    spec: CaptureSpec
    batch_tokens: int

    def _batches(self, samples: list[list[int]], names: list[str]
                 ) -> Iterator[tuple[list[list[int]], list[str]]]:
        for idx in length_batches([len(s) for s in samples], self.batch_tokens):
            yield [samples[i] for i in idx], [names[i] for i in idx]

    def __call__(self, samples: list[list[int]], names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        for batch, named in self._batches(samples, names):
            yield from forward_hidden(self.model, batch, self.spec, named)

    def encoded(self, samples: list[list[int]], names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Each sample as the shard stores it, encoded on the target's device (`launch_batch`).
        Each batch's forward is queued before the host waits for the previous batch's copy and
        takes its rows, so on a GPU the host's share (the wait, the finite check, the rows)
        runs while the next forward computes, and at most two batches' buffers are held."""
        pending: HostBatch | None = None
        for batch, named in self._batches(samples, names):
            launched = launch_batch(self.model, batch, self.spec, named)
            if pending is not None:
                yield from pending.samples()
            pending = launched
        if pending is not None:
            yield from pending.samples()


def stored_sample(item: dict[str, torch.Tensor], spec: CaptureSpec) -> dict[str, torch.Tensor]:
    """A `Capturer`'s sample (float32 fields, `TOP`) as the shard stores it (`encode`)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in item.items():
        out |= {TOP: value} if name == TOP else encode(name, value, spec.groups(name), spec.storage_dtype)
    return out


def capture_shard(
    capture: Capturer | None, samples: list[Tokenized], spec: CaptureSpec
) -> dict[str, torch.Tensor]:
    """The tensors of one shard: samples concatenated along tokens, `offsets` [n+1] delimits them;
    `capture` gives what `spec` keeps (None when it keeps tokens only), encoded on its device
    where it can (`Capturer`).

    Deterministic for a given sample list (the `hf` batches depend only on it), which is what
    lets a resumed run reproduce the shards of an uninterrupted one byte for byte.
    """
    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),
        "offsets": offsets,
    }
    if not spec.needs_forward:
        return tensors
    # Encoded per sample (or per batch) so a shard never holds more than one batch in float32.
    parts: dict[str, list[torch.Tensor]] = {}
    ids, names = [s.input_ids for s in samples], [sample_name(s, i) for i, s in enumerate(samples)]
    encoded = getattr(capture, "encoded", None)
    items = encoded(ids, names) if encoded else (stored_sample(item, spec) for item in capture(ids, names))
    for item in items:
        for k, v in item.items():
            parts.setdefault(k, []).append(v)
    return tensors | {k: torch.cat(v) for k, v in parts.items()}


@torch.inference_mode()
def bare_forward(model, shards: list[list[Tokenized]], batch_tokens: int, full_logits: bool) -> None:
    """The target's forward over the capture's batches, keeping nothing: the speed of light that
    capture and regeneration are measured against (`scripts/bench_capture.py`, `bench_regen.py`).
    Without `full_logits` it skips the full-vocabulary lm_head, as capture does where it keeps
    no top-1 (`CaptureSpec.target_top`)."""
    for shard in shards:
        lengths = [len(t.input_ids) for t in shard]
        for idx in length_batches(lengths, batch_tokens):
            ids = pad_batch([shard[i].input_ids for i in idx], input_device(model))
            extra = {} if full_logits else {"logits_to_keep": 1}
            attention = attention_inputs(model, ids, None, may_sync=True)
            model(input_ids=ids, **attention, use_cache=False, **extra)
