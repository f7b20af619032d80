"""P-EAGLE: an EAGLE-3 head that drafts its tokens in one forward. `model` holds the head, `export`
its formats, and `KIND` its record, which `heads.kinds` lists."""

from __future__ import annotations

from conf.kinds import PEagleConfig
from heads.peagle import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=PEagleConfig,
    captured_layers=model.captured_layers,
    draft_vocab=True,
    served_shape="chain",
    chains_only=True,
    static_tree=False,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="P-EAGLE draft head",
    serve_lines=export.serve_lines,
    bench_fields=("parallel_tokens", "anchor_fraction"),
    card_facts=export.card_facts,
    served_tokens=export.served_tokens,
    target_top=True,  # EAGLE-3's teacher over the draft vocabulary
    engine_keys=export.speculative_keys,
    check_target=model.check_target,
)
