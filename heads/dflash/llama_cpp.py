"""DFlash heads as llama.cpp's draft model: `export.formats=[dflash-gguf]`, one `draft.gguf` that
`llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash` loads. DSpark's writer
(`heads.dspark.llama_cpp`) subclasses this one.

Every key and tensor below was read off the llama.cpp that llama-cpp-python 0.3.36 vendors:

- `src/models/dflash.cpp` (architecture `dflash`): `load_arch_hparams` reads
  `dflash.attention.layer_norm_rms_epsilon`, `dflash.block_size` and `dflash.target_layers`
  (required); `load_arch_tensors`: `fc.weight` {n_ids*H, H} (so the fused width is the draft's
  own H: the target's hidden size must be the draft's, as ours always is), `enc.output_norm`
  (our `hidden_norm`), `output_norm` (our `norm`), per layer `attn_norm`, `attn_q/k/v`,
  `attn_output`, `attn_q_norm`, `attn_k_norm`, `ffn_norm`, `ffn_gate/up/down`; no `token_embd`
  and no `output`: the target's are shared through the context (`ctx_other`), as vLLM and our
  head share them.
- The graph, both halves ours: an embeddings batch of target features is fused (`fc` ->
  `enc.output_norm`) and written into each layer's K/V cache as `k_norm(wk x)` roped and `wv x`,
  never passing through a layer; a token batch (the anchor, then mask tokens) runs the layers
  (pre-norm, Qwen3 attention with per-head q/k norms), attends to the cache and the block, then
  `output_norm` and the target's lm_head. `llama_model_rope_type` ropes DFlash as NEOX (our
  half-split), so no q/k rows are permuted.
- `common/speculative.cpp` (draft-dflash): `dflash.block_size`, `dflash.attention.causal` (false:
  the block attends to itself whole, DFlash's own), the draft vocabulary's mask token
  (`tokenizer.ggml.mask_token_id`), `target_layers` read as layer *inputs*
  (`llama_get_embeddings_layer_inp`): HF `hidden_states[k]`, our aux ids unshifted (the converter
  adds one to vLLM's `target_layer_ids`). It drafts `--spec-draft-n-max` tokens, clamped to
  block_size - 1, reading slots 1.. greedily.
- Vocabulary (`src/llama-vocab.cpp`): the mask token id is read only from a real vocabulary (with
  `tokenizer.ggml.model` "none" it stays null), so the file carries a placeholder SentencePiece
  one: the target's vocabulary size in distinct `<tok_i>` pieces, no scores, the mask id. The
  draft never tokenizes (the server tokenizes with the target) and draft-dflash compares no
  vocabularies; its logits are the target's lm_head over that many ids.
- Storage as `heads.eagle3.llama_cpp`: norms F32, matrices the export dtype.
Not expressible, refused: a sliding window, a scaled rope, aux ids past the target's last layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from conf.errors import UserError
from heads.export import llama_cpp as gguf_draft
from heads.export.card import CardFacts
from heads.export.core import ExportContext, Layout, Tensors, check_layout
from heads.export.gguf_file import Value, read_gguf
from heads.export.llama_cpp import ARRAY, BOOL, I32, LAYER_KEYS, STRING, U32, WEIGHTS_FILE, Schema
from heads.window import asked_window

# Per-layer tensors: our names (after `layers.{i}.`) -> llama.cpp's (after `blk.{i}.`).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight"}


def placeholder_tokens(n: int) -> list[str]:
    """The draft vocabulary's pieces: distinct, never tokenized (module docstring)."""
    return [f"<tok_{i}>" for i in range(n)]


class DFlashGGUF:
    """The `dflash-gguf` layout; a derived kind's writer adds keys (`extra_keys` / `extra_values`),
    tensors (`extra_names`), config fields read back (`extra_fields`) and refusals. `shapes`: the
    kind's own tensor shapes for a head config (its export module's), which the reader holds the
    file to."""

    fmt, arch, spec_type = "dflash-gguf", "dflash", "draft-dflash"
    extra_keys: ClassVar[dict] = {}

    def __init__(self, shapes: Callable[[dict], dict[str, tuple[int, ...]]]) -> None:
        self.shapes = shapes
        self.schema = Schema(self.arch, {
            **LAYER_KEYS,
            ".attention.causal": BOOL,
            ".target_layers": (ARRAY, I32),
            ".block_size": U32,
            **self.extra_keys,
            "tokenizer.ggml.model": STRING,
            "tokenizer.ggml.tokens": (ARRAY, STRING),
            "tokenizer.ggml.mask_token_id": U32,
        })

    # ---- what llama.cpp cannot express ------------------------------------------------------
    def refusal(self, cfg: dict, target_layers: int | None = None) -> str | None:
        """Why llama.cpp's DFlash graph would serve a head of these settings as another head, or
        None. `cfg`: a saved head's config or a command's `head.*` settings (the target's rope
        and aux ids are then checked at export)."""
        if (window := asked_window(cfg)) is not None:
            return f"head.sliding_window={window}: this export writes no window for llama.cpp"
        if (reason := gguf_draft.scaled_rope(cfg)) is not None:
            return reason
        if "target_hidden_size" in cfg and cfg["target_hidden_size"] != cfg["hidden_size"]:
            return (f"target_hidden_size {cfg['target_hidden_size']} != hidden_size {cfg['hidden_size']}: "
                    "llama.cpp fuses target features of the draft's own width")
        ids = sorted(cfg.get("aux_layer_ids") or ())
        if target_layers is not None and ids and ids[-1] >= target_layers:
            return (f"head.aux_layer_ids={ids}: llama.cpp captures layer inputs of the {target_layers}-layer "
                    f"target, ids 0..{target_layers - 1}")
        return None

    def check_expressible(self, cfg: dict, target_layers: int) -> None:
        reason = self.refusal(cfg, target_layers)
        if reason is not None:
            vllm = self.fmt.removesuffix("-gguf")
            raise UserError(f"export.formats={self.fmt}: {reason}; export {vllm} (vLLM) instead")

    # ---- writing ------------------------------------------------------------------------------
    def names(self, cfg: dict) -> dict[str, str]:
        """Our tensor names -> llama.cpp's, for a head of `cfg`'s layers."""
        per_layer = {f"layers.{i}.{ours}": f"blk.{i}.{theirs}"
                     for i in range(cfg["num_hidden_layers"]) for ours, theirs in LAYER_NAMES.items()}
        return TOP_NAMES | per_layer | self.extra_names(cfg)

    def extra_names(self, cfg: dict) -> dict[str, str]:
        return {}

    def extra_values(self, cfg: dict) -> dict:
        return {}

    def metadata(self, cfg: dict, ctx: ExportContext) -> dict[str, Value]:
        """The GGUF's key/values for a head config, refusing what llama.cpp cannot express first."""
        self.check_expressible(cfg, ctx.target.num_hidden_layers)
        key = self.schema.key
        values = {
            **gguf_draft.layer_values(self.schema, cfg, ctx, blocks=cfg["num_hidden_layers"]),
            key("attention.causal"): bool(cfg["causal"]),
            key("target_layers"): sorted(cfg["aux_layer_ids"]),
            key("block_size"): cfg["block_size"],
            **self.extra_values(cfg),
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": placeholder_tokens(cfg["vocab_size"]),
            "tokenizer.ggml.mask_token_id": cfg["mask_token_id"],
        }
        return self.schema.typed(values)

    def tensors(self, tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
        """Our tensors in llama.cpp's names: matrices in `dtype`, 1-D ones F32 holding the
        `dtype` values (the converter's storage)."""
        names = self.names(cfg)
        return {names[k]: (t.to(dtype).float() if t.dim() == 1 else t.to(dtype)) for k, t in tensors.items()}

    # ---- reading ------------------------------------------------------------------------------
    def extra_fields(self, get, stored: Tensors, where: str) -> dict:
        """Config fields a derived kind reads back (`get`: an architecture key's value)."""
        return {}

    def read(self, folder: Path) -> tuple[dict, Tensors]:
        """Our loader for the GGUF, reading what llama.cpp reads: (head config kwargs, tensors in
        our names, in the dtype of its matrices), or one line naming what is wrong."""
        where = f"{self.fmt} export {folder}"
        meta, stored = read_gguf(Path(folder) / WEIGHTS_FILE, where)
        self.schema.check(meta, where)

        def get(name: str):
            return meta[self.schema.key(name)].value

        tokens = meta["tokenizer.ggml.tokens"].value
        if meta["tokenizer.ggml.model"].value != "llama" or tokens != placeholder_tokens(len(tokens)):
            raise UserError(f"{where}: expected the placeholder vocabulary this export writes")
        cfg = {
            **gguf_draft.read_layer_fields(get, where),
            "num_hidden_layers": get("block_count"),
            "vocab_size": len(tokens),
            "rope_parameters": {"rope_type": "default", "rope_theta": get("rope.freq_base")},
            "hidden_act": "silu",
            "attention_bias": False,
            "aux_layer_ids": sorted(get("target_layers")),
            "target_hidden_size": get("embedding_length"),
            "block_size": get("block_size"),
            "causal": bool(get("attention.causal")),
            "mask_token_id": meta["tokenizer.ggml.mask_token_id"].value,
            **self.extra_fields(get, stored, where),
        }
        ours = {theirs: name for name, theirs in self.names(cfg).items()}
        unknown = sorted(set(stored) - set(ours))
        if unknown:
            raise UserError(f"{where}: unknown tensors {unknown}")
        tensors = {ours[k]: v for k, v in stored.items()}
        check_layout(tensors, self.shapes(cfg), where)
        dtype = tensors["fc.weight"].dtype
        want = {k: dtype if v.dim() > 1 else torch.float32 for k, v in tensors.items()}
        wrong = {k: v.dtype for k, v in tensors.items() if v.dtype != want[k]}
        if wrong:
            raise UserError(f"{where}: matrices must all be {dtype} (fc.weight's), 1-D tensors F32: {wrong}")
        return cfg, {k: v.to(dtype) for k, v in tensors.items()}

    # ---- the model card and the catalog ---------------------------------------------------------
    def serve_lines(self, f: CardFacts) -> list[str]:
        return gguf_draft.serve_lines(f, self.spec_type)

    def layout(self) -> Layout:
        marker = gguf_draft.marker(self.fmt, self.arch)
        return Layout(WEIGHTS_FILE, self.metadata, self.read, lambda top: top == marker, "gguf",
                      self.tensors, save=gguf_draft.saver(self.fmt, self.arch), refuses=self.refusal)
