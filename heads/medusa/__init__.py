"""Medusa: heads that each draft one position ahead. `model` holds the head, `export` its formats,
and `KIND` its record, which `heads.kinds` lists."""

from __future__ import annotations

from conf.kinds import MedusaConfig
from heads.medusa import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=MedusaConfig,
    captured_layers=model.captured_layers,
    draft_vocab=False,
    served_shape="tree",
    chains_only=False,
    static_tree=True,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="Medusa heads",
    serve_lines=export.serve_lines,
    bench_fields=("num_heads", "joint", "lora_rank"),
    served_tokens=export.served_tokens,
)
