"""EAGLE-3: the fusion draft head. `model` holds the head, `export` its formats, and `KIND` its
record, which `heads.kinds` lists."""

from __future__ import annotations

from conf.kinds import Eagle3Config
from heads.eagle3 import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=Eagle3Config,
    captured_layers=model.captured_layers,
    draft_vocab=True,
    served_shape="chain",
    chains_only=False,
    static_tree=False,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="EAGLE-3 draft head",
    serve_lines=export.serve_lines,
    bench_fields=("ttt_length",),
    card_facts=export.card_facts,
    target_top=True,
)
