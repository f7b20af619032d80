"""DFlash: a block of mask slots drafted in one forward. `model` holds the head, `export` its
formats, and `KIND` its record, which `heads.kinds` lists."""

from __future__ import annotations

from conf.kinds import DFlashConfig
from heads.dflash import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=DFlashConfig,
    captured_layers=model.captured_layers,
    draft_vocab=False,  # the target's whole vocabulary, through its own lm_head (vLLM shares it)
    served_shape="chain",
    chains_only=True,
    static_tree=False,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="DFlash block draft head",
    serve_lines=export.serve_lines,
    bench_fields=("num_layers", "block_size", "anchors_per_sample"),
    card_facts=export.card_facts,
    served_tokens=export.served_tokens,
    check_target=model.check_target,
)
