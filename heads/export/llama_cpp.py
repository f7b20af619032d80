"""What every llama.cpp draft layout shares (`heads/<kind>/llama_cpp.py` says which keys and
tensors its architecture reads): the typed key schema and its strict check, the folder (one
GGUF beside a config.json marker naming its format, so `detect_format` finds it as it finds
every other export), and the model card's `llama-server` line.

llama.cpp checks a scalar key's GGUF type exactly and fills a key it does not find with a
default that serves another head, so a draft's metadata is held to one schema both ways: the
writer types every key by it, the reader refuses unknown, missing and retyped keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from conf.errors import UserError
from heads.export.card import CardFacts, hub_id
from heads.export.core import ExportContext, Tensors, legacy_rope
from heads.export.gguf_file import ARCH_KEY, Value, file_type, write_gguf

U32, I32, F32, BOOL = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
STRING, ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
WEIGHTS_FILE = "draft.gguf"
# The keys `src/llama-model.cpp` `load_hparams` reads for every architecture, as the converter
# types them (`general.file_type` names the matrices' storage; norms stay F32).
LAYER_KEYS = {
    "general.file_type": U32,
    ".context_length": U32,
    ".embedding_length": U32,
    ".block_count": U32,
    ".feed_forward_length": U32,
    ".attention.head_count": U32,
    ".attention.head_count_kv": U32,
    ".attention.key_length": U32,
    ".attention.value_length": U32,
    ".attention.layer_norm_rms_epsilon": F32,
    ".rope.dimension_count": U32,
    ".rope.freq_base": F32,
}


@dataclass(frozen=True)
class Schema:
    """One draft architecture's keys: `types` maps a key (without the `<arch>.` prefix where it
    starts with `.`, e.g. `.block_count`) to its GGUF type, an array's to (ARRAY, element type)."""

    arch: str
    types: dict[str, GGUFValueType | tuple[GGUFValueType, GGUFValueType]]

    def key(self, name: str) -> str:
        """The full key of an architecture key `name` (`block_count` -> `dflash.block_count`)."""
        return f"{self.arch}.{name}"

    def full(self) -> dict[str, tuple[GGUFValueType, GGUFValueType | None]]:
        """Every key written, full names, (type, element type or None); `general.architecture`
        first, as the writer puts it."""
        types = {ARCH_KEY: STRING, **self.types}
        return {(self.key(k[1:]) if k.startswith(".") else k): (t if isinstance(t, tuple) else (t, None))
                for k, t in types.items()}

    def typed(self, values: dict[str, object]) -> dict[str, Value]:
        """`values` (full key names, every key but the architecture's) typed by the schema."""
        types = self.full()
        return {k: Value(types[k][0], v, types[k][1]) for k, v in values.items()}

    def check(self, meta: dict[str, Value], where: str) -> None:
        """Refuse metadata that is not exactly this schema's keys, each of its type."""
        arch = meta.get(ARCH_KEY)
        if arch is None or arch.value != self.arch:
            raise UserError(f"{where}: {ARCH_KEY} is {arch and arch.value!r}, expected {self.arch!r}")
        types = self.full()
        unknown, missing = sorted(set(meta) - set(types)), sorted(set(types) - set(meta))
        wrong = sorted(k for k in set(types) & set(meta) if (meta[k].type, meta[k].sub_type) != types[k])
        if unknown or missing or wrong:
            raise UserError(f"{where}: unknown keys {unknown}, missing {missing}, of another type {wrong}")


def scaled_rope(cfg: dict) -> str | None:
    """Why a head whose rope scales positions is refused (none of the drafts' keys write a rope
    scaling, so llama.cpp would rope it unscaled), or None. A command's `head.*` settings carry no
    rope: the target's is checked at export."""
    if "rope_parameters" in cfg and legacy_rope(cfg["rope_parameters"])[1] is not None:
        return (f"the draft's rope_parameters {cfg['rope_parameters']} (its target's) scale "
                "positions, which this export does not write for llama.cpp")
    return None


def layer_values(schema: Schema, cfg: dict, ctx: ExportContext, blocks: int) -> dict[str, object]:
    """`LAYER_KEYS`' values for a draft of `blocks` layers of a Llama/Qwen3-style head config (one
    head dim for keys, values and the rope; no rope scaling, which each layout refuses first)."""
    key = schema.key
    return {
        "general.file_type": file_type(ctx.gguf_type),
        key("context_length"): cfg["max_position_embeddings"],
        key("embedding_length"): cfg["hidden_size"],
        key("block_count"): blocks,
        key("feed_forward_length"): cfg["intermediate_size"],
        key("attention.head_count"): cfg["num_attention_heads"],
        key("attention.head_count_kv"): cfg["num_key_value_heads"],
        key("attention.key_length"): cfg["head_dim"],
        key("attention.value_length"): cfg["head_dim"],
        key("attention.layer_norm_rms_epsilon"): float(cfg["rms_norm_eps"]),
        key("rope.dimension_count"): cfg["head_dim"],
        key("rope.freq_base"): legacy_rope(cfg["rope_parameters"])[0],
    }


def read_layer_fields(get, where: str) -> dict:
    """The head config fields `layer_values` wrote (`get`: an architecture key's value)."""
    head_dim = get("attention.key_length")
    if get("attention.value_length") != head_dim or get("rope.dimension_count") != head_dim:
        raise UserError(f"{where}: value_length and rope.dimension_count must be key_length (head dim)")
    return {
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": get("context_length"),
    }


def marker(fmt: str, arch: str) -> dict:
    """The config.json beside a draft: its format, llama.cpp's architecture and the file."""
    return {"format": fmt, "architecture": arch, "file": WEIGHTS_FILE}


def saver(fmt: str, arch: str):
    """A `Layout.save` writing the marker and the GGUF."""

    def save(folder: Path, weights_file: str, metadata: dict[str, Value], tensors: Tensors) -> None:
        (folder / "config.json").write_text(json.dumps(marker(fmt, arch), indent=2) + "\n")
        write_gguf(folder / weights_file, arch, metadata, tensors)

    return save


def serve_lines(f: CardFacts, spec_type: str) -> list[str]:
    """The model card's llama.cpp command: the target as a GGUF, this file as its draft."""
    target = f.target_name if f.target_name.endswith(".gguf") else "target.gguf"
    draft = f"-hfd {f.location}" if hub_id(f.location) else f"-md {Path(f.location) / WEIGHTS_FILE}"
    lines = ["llama.cpp:", ""]
    if target == "target.gguf":
        name = hub_id(f.target_name) or f.target_name
        lines += [f"`target.gguf` is `{name}` as a GGUF (llama.cpp's `convert_hf_to_gguf.py` writes one).",
                  ""]
    k = f.num_speculative_tokens
    return lines + [
        "```bash",
        f"llama-server -m {target} {draft} --spec-type {spec_type} --spec-draft-n-max {k} "
        f"--spec-draft-p-min {f.draft_p_min:g}",
        "```",
    ]
