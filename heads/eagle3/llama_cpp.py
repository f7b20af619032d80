"""EAGLE-3 heads as llama.cpp's draft model: `export.formats=gguf`, one `draft.gguf` that
`llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3` loads.

Every key and tensor below was read off the llama.cpp that llama-cpp-python 0.3.36 vendors:

- `src/models/eagle3.cpp` `load_arch_hparams`: `eagle3.attention.layer_norm_rms_epsilon` (every
  RMSNorm's eps), `eagle3.target_layers` (required, exactly 3 INT32/UINT32), `eagle3.target_hidden_size`,
  `eagle3.norm_before_residual` and `eagle3.norm_before_fc` (optional, default false: written
  always, as the native layout writes its flags). `load_arch_tensors`: `fc.weight`
  {3*Ht, H}; `enc.output_norm.weight` {3*Ht} only with norm_before_fc; `output_norm.weight`;
  `output.weight` {H, draft vocab} (optional: without it the target's lm_head drafts, so the
  reader requires it); `token_embd.weight` optional (absent: the target's, as our head uses);
  `blk.0.attn_norm` (the token embedding's norm), `blk.0.attn_norm_2` (hidden_norm), attn_q/k/v
  {2H, ...}, attn_output, ffn_norm, ffn_gate/up/down; `d2t` {draft vocab} I64, optional (absent:
  the draft vocabulary is the target's).
- `src/llama-model.cpp` `load_hparams` (every architecture): `eagle3.context_length`,
  `embedding_length`, `block_count` required; `feed_forward_length`, `attention.head_count(_kv)`,
  `attention.key_length`/`value_length` (else H / heads), `rope.dimension_count`,
  `rope.freq_base`; no rope scaling key means none. `llama_model_rope_type`: EAGLE3 ropes as
  LLAMA_ROPE_TYPE_NORM (adjacent pairs), so q and k rows are permuted from HF's rotate-half order
  exactly as the converter does (`conversion/llama.py` `LlamaModel.permute`, applied to eagle3
  drafts too).
- `src/models/eagle3.cpp` graph: encoder = [enc.output_norm] -> fc; decoder = concat(attn_norm(
  embed), attn_norm_2(g)), residual g or, with norm_before_residual, attn_norm_2(g); ffn_norm,
  SwiGLU, residual; the pre-norm state is fed back (`t_h_nextn`), output_norm -> output -> logits
  scattered into the target vocabulary at `d2t` (absolute target ids, as `conversion/llama.py`
  `prepare_tensors` writes `d2t + arange`). So EAGLE 3.1's `fc_norm`, `norm_output` (the normed
  state fed back) and a sliding window are not expressible: such heads are refused.
- `common/speculative.cpp` (draft-eagle3): target layer id k < n_layer captures the *input* of
  target layer k (`llama_get_embeddings_layer_inp`; `src/models/llama.cpp` stores `t_layer_inp[il]
  = inpL` at the top of layer il), the residual stream after k layers: HF `hidden_states[k]`, our
  own numbering, written unshifted (`conversion/llama.py` writes `eagle_aux_hidden_state_layer_ids`
  as they are). k == n_layer reads the target's MTP state instead of HF's normed last hidden state,
  so the last id must be below the target's layer count. Features are concatenated in the listed
  order (ascending, as `Eagle3Head.fuse` reads them).
- Vocabulary: `src/llama-vocab.cpp` requires `tokenizer.ggml.model`; "none" gives
  `eagle3.vocab_size` placeholder tokens, which is all the draft needs (its logits are sized by
  `vocab.n_tokens()`, and the draft-eagle3 path runs no draft/target vocabulary comparison, unlike
  the plain `draft` type's `common_speculative_are_compatible`). The converter copies the target's
  tokenizer instead; without it the file needs no target, and llama-server drafts and verifies
  the same (checked by hand on SmolLM2's GGUF, identical greedy text with either).
- Storage (`conversion/base.py`): norms and other 1-D tensors F32, matrices the export dtype
  (F32, F16, BF16: llama.cpp multiplies all three on CPU), `general.file_type` to match.

Beside the file, a config.json names the format, so that `detect_format` and the readers of
`heads.formats` find the folder as they find every other export; `read_export` reads the GGUF
alone, strictly (unknown or missing keys and tensors are errors: llama.cpp fills a missing
optional one with a default that serves another head).
"""

from __future__ import annotations

from pathlib import Path

import torch

from conf.errors import UserError
from heads.export import llama_cpp as gguf_draft
from heads.export.card import CardFacts
from heads.export.core import ExportContext, Layout, Tensors, check_layout
from heads.export.gguf_file import Value, read_gguf
from heads.export.llama_cpp import ARRAY, BOOL, I32, LAYER_KEYS, STRING, U32, WEIGHTS_FILE, Schema
from heads.parts import NORM_FLAGS, norm_flags
from heads.window import asked_window

ARCH, FORMAT = "eagle3", "gguf"
MARKER = gguf_draft.marker(FORMAT, ARCH)  # the folder's config.json
EXPRESSIBLE = ("norm_before_fc", "norm_before_residual")  # the flags llama.cpp reads; the rest off

# Every key written, with its GGUF type (the converter's; llama.cpp checks scalar types exactly).
SCHEMA = Schema(ARCH, {
    **LAYER_KEYS,
    ".vocab_size": U32,
    ".target_layers": (ARRAY, I32),
    ".target_hidden_size": U32,
    **{f".{k}": BOOL for k in EXPRESSIBLE},
    "tokenizer.ggml.model": STRING,
})
key = SCHEMA.key

# Our tensor names -> llama.cpp's (`d2t` keeps its name; `t2d` is not written: nothing reads it).
NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}
OURS = {gguf: ours for ours, gguf in NAMES.items()}
# The q and k rows rotated by rope -> their heads, as our config and the GGUF's key name them.
ROPE_ROWS = {
    "blk.0.attn_q.weight": ("num_attention_heads", "attention.head_count"),
    "blk.0.attn_k.weight": ("num_key_value_heads", "attention.head_count_kv"),
}


def refusal(cfg: dict, target_layers: int | None = None) -> str | None:
    """Why llama.cpp's EAGLE-3 graph would serve a head of these settings as another head (module
    docstring), or None. `cfg` is a saved head's config, or the `head.*` settings of a command
    not yet run (its rope and aux layer ids, the target's, are then checked at export)."""
    off = [k for k, v in norm_flags(cfg).items() if v and k not in EXPRESSIBLE]
    if off:
        return (f"head.{off[0]}=true, which llama.cpp's EAGLE-3 draft cannot express (it reads only "
                f"{' and '.join(EXPRESSIBLE)})")
    if (window := asked_window(cfg)) is not None:
        return f"head.sliding_window={window}: llama.cpp's EAGLE-3 draft attends over every position"
    if (reason := gguf_draft.scaled_rope(cfg)) is not None:
        return reason
    ids = sorted(cfg.get("aux_layer_ids") or ())
    if target_layers is not None and (len(ids) != 3 or ids[-1] >= target_layers):
        return (f"head.aux_layer_ids={ids}: llama.cpp captures exactly 3 layer inputs of the "
                f"{target_layers}-layer target, ids 0..{target_layers - 1}")
    return None


def check_expressible(cfg: dict, target_layers: int) -> None:
    """Refuse, before anything is written, a head llama.cpp would serve as another, in one line."""
    reason = refusal(cfg, target_layers)
    if reason is not None:
        raise UserError(f"export.formats=gguf: {reason}; export eagle3 or speculators (vLLM) instead")


def has_d2t(cfg: dict) -> bool:
    """llama.cpp takes a draft without `d2t` as drafting over the whole target vocabulary."""
    return cfg["draft_vocab_size"] != cfg["vocab_size"]


def gguf_metadata(cfg: dict, ctx: ExportContext) -> dict[str, Value]:
    """The GGUF's key/values for a head config (the layout's `config`), refusing what llama.cpp
    cannot express first."""
    check_expressible(cfg, ctx.target.num_hidden_layers)
    flags = norm_flags(cfg)
    values = {  # general.architecture: the writer's own first key
        **gguf_draft.layer_values(SCHEMA, cfg, ctx, blocks=1),
        key("vocab_size"): cfg["vocab_size"],
        key("target_layers"): sorted(cfg["aux_layer_ids"]),
        key("target_hidden_size"): cfg["target_hidden_size"],
        **{key(k): flags[k] for k in EXPRESSIBLE},
        "tokenizer.ggml.model": "none",
    }
    return SCHEMA.typed(values)


def rope_rows(w: torch.Tensor, heads: int, back: bool = False) -> torch.Tensor:
    """q or k rows from HF's rotate-half order to llama.cpp's adjacent pairs per head
    (`conversion/llama.py` `LlamaModel.permute`), or `back`."""
    half = w.shape[0] // heads // 2
    split = (heads, half, 2) if back else (heads, 2, half)
    return w.reshape(*split, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
    """Our tensors as the GGUF stores them: llama.cpp's names, q/k rows permuted, matrices in
    `dtype`, norms F32 holding the `dtype` values, `d2t` as absolute target ids (none for a full
    draft vocabulary), no `t2d`."""
    out = {}
    for ours, t in tensors.items():
        if ours == "t2d" or (ours == "d2t" and not has_d2t(cfg)):
            continue
        name = NAMES[ours]
        if name == "d2t":
            out[name] = t.long() + torch.arange(len(t))
            continue
        w = t.to(dtype)
        if name in ROPE_ROWS:
            w = rope_rows(w, cfg[ROPE_ROWS[name][0]])
        out[name] = w.float() if w.dim() == 1 else w
    return out


def check_metadata(meta: dict[str, Value], where: str) -> None:
    """Refuse metadata that is not exactly the keys this export writes, each of its type: llama.cpp
    would read a key we do not write (a rope scaling, a window) into another head."""
    SCHEMA.check(meta, where)
    if meta[key("block_count")].value != 1 or len(meta[key("target_layers")].value) != 3:
        raise UserError(f"{where}: {key('block_count')} must be 1 and {key('target_layers')} hold 3 ids")


def expected_shapes(get, draft_vocab: int, d2t: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp loads for this metadata (`get`: a key's value), in torch's order
    (its ne reversed)."""
    h, ff, hd = get("embedding_length"), get("feed_forward_length"), get("attention.key_length")
    q, kv = get("attention.head_count") * hd, get("attention.head_count_kv") * hd
    fused = 3 * get("target_hidden_size")
    return {
        "fc.weight": (h, fused),
        **({"enc.output_norm.weight": (fused,)} if get("norm_before_fc") else {}),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.attn_norm_2.weight": (h,),
        "blk.0.attn_q.weight": (q, 2 * h),
        "blk.0.attn_k.weight": (kv, 2 * h),
        "blk.0.attn_v.weight": (kv, 2 * h),
        "blk.0.attn_output.weight": (h, q),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.ffn_gate.weight": (ff, h),
        "blk.0.ffn_up.weight": (ff, h),
        "blk.0.ffn_down.weight": (h, ff),
        "output_norm.weight": (h,),
        "output.weight": (draft_vocab, h),
        **({"d2t": (draft_vocab,)} if d2t else {}),
    }


def _vocab(d2t: torch.Tensor | None, draft_vocab: int, vocab: int, where: str) -> Tensors:
    """Our `d2t` (offsets) and `t2d` from llama.cpp's absolute ids, refused where they leave the
    target vocabulary or repeat (the converter's own checks); identity without `d2t`."""
    if d2t is None:
        return {"d2t": torch.zeros(draft_vocab, dtype=torch.long), "t2d": torch.ones(vocab, dtype=torch.bool)}
    if d2t.dtype != torch.int64:
        raise UserError(f"{where}: d2t is {d2t.dtype}, expected I64 (llama.cpp asserts it)")
    if int(d2t.min()) < 0 or int(d2t.max()) >= vocab or len(d2t.unique()) != len(d2t):
        raise UserError(f"{where}: d2t must map each draft id to a distinct one of the {vocab} target ids")
    t2d = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, d2t, True)
    return {"d2t": d2t - torch.arange(draft_vocab), "t2d": t2d}


def read_export(folder: Path) -> tuple[dict, Tensors]:
    """Our loader for the GGUF, reading what llama.cpp reads: (draft config kwargs, tensors in our
    names, in the dtype of its matrices), or one line naming what is wrong."""
    where = f"gguf export {folder}"
    meta, stored = read_gguf(Path(folder) / WEIGHTS_FILE, where)
    check_metadata(meta, where)

    def get(name: str):
        return meta[key(name)].value

    d2t = stored.get("d2t")
    draft_vocab = d2t.shape[0] if d2t is not None and d2t.dim() == 1 else get("vocab_size")
    check_layout(stored, expected_shapes(get, draft_vocab, d2t is not None), where)
    dtype = stored["fc.weight"].dtype
    want = {k: dtype if v.dim() == 2 else torch.float32 for k, v in stored.items() if k != "d2t"}
    wrong = {k: stored[k].dtype for k, t in want.items() if stored[k].dtype != t}
    if wrong:
        raise UserError(f"{where}: matrices must all be {dtype} (fc.weight's) and norms F32: {wrong}")
    tensors = {
        OURS[k]: rope_rows(v, get(ROPE_ROWS[k][1]), back=True) if k in ROPE_ROWS else v.to(dtype)
        for k, v in stored.items()
        if k != "d2t"
    }
    cfg = {
        **gguf_draft.read_layer_fields(get, where),
        "vocab_size": get("vocab_size"),
        "rope_theta": get("rope.freq_base"),
        "rope_scaling": None,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": get("target_hidden_size"),
        "aux_layer_ids": list(get("target_layers")),
        **{k: k in EXPRESSIBLE and bool(get(k)) for k in NORM_FLAGS},
    }
    return cfg, tensors | _vocab(d2t, draft_vocab, cfg["vocab_size"], where)


def serve_lines(f: CardFacts) -> list[str]:
    """The model card's llama.cpp command: the target as a GGUF, this file as its draft."""
    return gguf_draft.serve_lines(f, "draft-eagle3")


LAYOUT = Layout(
    WEIGHTS_FILE,
    gguf_metadata,
    read_export,
    lambda top: top == MARKER,
    "gguf",
    gguf_tensors,
    save=gguf_draft.saver(FORMAT, ARCH),
    refuses=refusal,
)
