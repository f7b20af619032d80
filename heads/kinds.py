"""A head kind is one record: everything the rest of the code asks about EAGLE-3, Medusa, P-EAGLE
or DFlash.

Data prep asks which layers to capture, whether there is a draft vocabulary and whether to keep
the target's top-1 id per token (a teacher over a draft vocabulary needs it); the evaluator
asks how the head is usually served and how to load it for decoding; export asks its formats,
their layouts, the self-check and the model card's title and serve commands; the trainer asks for
its trainee and drafter. Each answer is a field of `HeadKind`, so no module outside a kind's own
branches on the kind's name (`tests/unit/test_kind_branches.py` holds the line).

A new kind (EAGLE 3.1's successors, DSpark, ...) supplies:
- its config class in `conf/schema.py` (its `name` default is the kind's name) with the YAML
  group `conf/head/<name>.yaml`, listed in `conf.schema.HEAD_CONFIGS`: the one schema stays in
  conf, which cannot import this module;
- `heads/<name>.py`: the head module (`kind = <name>`, `save_pretrained`/`from_pretrained`),
  `captured_layers` and `load_for_decoding`;
- `heads/export/<name>.py`: its formats' `Layout`s, the self-check's `KindOps`, `serve_lines`
  (and `card_facts` / `served_tokens` / `engine_keys` where the defaults below do not fit:
  vLLM serves a P-EAGLE folder as method "eagle3" with parallel drafting, not as "peagle");
- `trainer/<name>_trainee.py`: the trainee builder and the drafter builder, with the decoding
  drafter in `trainer/decoding/`;
- one `HeadKind(...)` below, added to `KINDS`.

Layering: conf <- heads <- data_prep <- trainer. The record sits in heads, so it holds heads'
objects (config classes, layouts, checks, card text) directly and answers data prep with plain
values (`captured_layers` gives layer ids; `data_prep.prepare.capture_spec` wraps them in its
`CaptureSpec`). The trainee and the drafter are trainer code, a layer above: the record names
them as "module:function" strings, and only `trainer.kind_builders` imports them.

`heads.export` reads this module when it runs, not when it is imported (`from heads import
kinds`): the records hold the export modules' layouts, so each import waits for the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conf.errors import UserError
from conf.schema import DFlashConfig, Eagle3Config, MedusaConfig, PEagleConfig, RootConfig
from heads import dflash, eagle3, medusa, peagle
from heads.export import dflash as export_dflash
from heads.export import eagle3 as export_eagle3
from heads.export import medusa as export_medusa
from heads.export import peagle as export_peagle
from heads.export.card import CardFacts
from heads.export.check import KindOps
from heads.export.core import Layout
from heads.folder import head_kind as saved_kind_name


def _no_card_facts(cfg: dict, fmt: str) -> dict:
    return {}


def _asked_tokens(cfg: dict, asked: int) -> int:
    return asked


def _any_target(cfg: Any, target_config: Any) -> None:
    return None


@dataclass(frozen=True)
class HeadKind:
    """What the code asks about one head kind; the comments say who asks."""

    config: type  # conf.schema's config class; its `name` default is the kind's name
    # data_prep: (head config, target layer count) -> (aux layer ids, final layer id or None)
    captured_layers: Callable[[Any, int], tuple[tuple[int, ...], int | None]]
    draft_vocab: bool  # data_prep: whether it drafts over a reduced vocabulary (data.draft_vocab_size)
    served_shape: str  # evaluator: the shape eval.mode=auto decodes with, "chain" or "tree"
    static_tree: bool  # evaluator report: its trees are fixed choice paths, not grown per step
    # evaluator: (head folder, target, target name) -> (head module, the model that verifies)
    load_for_decoding: Callable[[Path | str, Any, str], tuple[Any, Any]]
    formats: dict[str, Layout]  # export: format name -> layout (export.formats=null: all of them)
    check: KindOps  # export: the self-check of a written folder
    title: str  # model card
    serve_lines: Callable[[CardFacts], list[str]]  # model card: how to serve one export
    trainee: str  # trainer: "module:function" (cfg, target, data folder or None) -> trainee
    drafter: str  # trainer: "module:function" (head, target, shapes) -> drafter
    bench_fields: tuple[str, ...]  # head config fields a benchmark line names
    # model card: extra CardFacts fields (layer_ids, notes) from the head config and the format
    card_facts: Callable[[dict, str], dict] = _no_card_facts
    # export and vLLM checks: (head config, asked num_speculative_tokens) -> tokens an engine drafts
    served_tokens: Callable[[dict, int], int] = _asked_tokens
    # data_prep: whether capture keeps the target's top-1 id per token (`data_prep.capture.TOP`),
    # which a teacher over a draft vocabulary needs (is the target's choice inside it?)
    target_top: bool = False
    # model card and vLLM checks: export format -> vLLM's speculative_config keys besides model and
    # num_speculative_tokens; None: {"method": <name>}
    engine_keys: Callable[[str], dict] | None = None
    # trainer: (head config, target config) -> None, refusing in one line a head setting this
    # target cannot take (a token id past its vocabulary), before any data stage runs
    check_target: Callable[[Any, Any], None] = _any_target

    @property
    def name(self) -> str:
        """+head=<name> and the `kind` of a saved head."""
        return self.config.name

    def speculative_keys(self, fmt: str) -> dict:
        """vLLM's speculative_config keys for an export in `fmt`, besides model and
        num_speculative_tokens: the method (the kind's name unless `engine_keys` says otherwise,
        as P-EAGLE's "eagle3" with parallel drafting)."""
        return {"method": self.name} if self.engine_keys is None else self.engine_keys(fmt)


EAGLE3 = HeadKind(
    config=Eagle3Config,
    captured_layers=eagle3.captured_layers,
    draft_vocab=True,
    served_shape="chain",
    static_tree=False,
    load_for_decoding=eagle3.load_for_decoding,
    formats=export_eagle3.FORMATS,
    check=export_eagle3.CHECK,
    title="EAGLE-3 draft head",
    serve_lines=export_eagle3.serve_lines,
    trainee="trainer.eagle3_trainee:build_eagle3_trainee",
    drafter="trainer.eagle3_trainee:eagle3_drafter",
    bench_fields=("ttt_length",),
    card_facts=export_eagle3.card_facts,
    target_top=True,
)

MEDUSA = HeadKind(
    config=MedusaConfig,
    captured_layers=medusa.captured_layers,
    draft_vocab=False,
    served_shape="tree",
    static_tree=True,
    load_for_decoding=medusa.load_for_decoding,
    formats=export_medusa.FORMATS,
    check=export_medusa.CHECK,
    title="Medusa heads",
    serve_lines=export_medusa.serve_lines,
    trainee="trainer.medusa_trainee:build_medusa_trainee",
    drafter="trainer.medusa_trainee:medusa_drafter",
    bench_fields=("num_heads", "joint", "lora_rank"),
    served_tokens=export_medusa.served_tokens,
)

PEAGLE = HeadKind(
    config=PEagleConfig,
    captured_layers=peagle.captured_layers,
    draft_vocab=True,
    served_shape="chain",
    static_tree=False,
    load_for_decoding=peagle.load_for_decoding,
    formats=export_peagle.FORMATS,
    check=export_peagle.CHECK,
    title="P-EAGLE draft head",
    serve_lines=export_peagle.serve_lines,
    trainee="trainer.peagle_trainee:build_peagle_trainee",
    drafter="trainer.peagle_trainee:peagle_drafter",
    bench_fields=("parallel_tokens", "anchor_fraction"),
    card_facts=export_peagle.card_facts,
    served_tokens=export_peagle.served_tokens,
    target_top=True,  # EAGLE-3's teacher over the draft vocabulary
    engine_keys=export_peagle.speculative_keys,
    check_target=peagle.check_target,
)

DFLASH = HeadKind(
    config=DFlashConfig,
    captured_layers=dflash.captured_layers,
    draft_vocab=False,  # the target's whole vocabulary, through its own lm_head (vLLM shares it)
    served_shape="chain",
    static_tree=False,
    load_for_decoding=dflash.load_for_decoding,
    formats=export_dflash.FORMATS,
    check=export_dflash.CHECK,
    title="DFlash block draft head",
    serve_lines=export_dflash.serve_lines,
    trainee="trainer.dflash_trainee:build_dflash_trainee",
    drafter="trainer.dflash_trainee:dflash_drafter",
    bench_fields=("num_layers", "block_size", "anchors_per_sample"),
    card_facts=export_dflash.card_facts,
    served_tokens=export_dflash.served_tokens,
    check_target=dflash.check_target,
)

KINDS: dict[str, HeadKind] = {k.name: k for k in (EAGLE3, MEDUSA, PEAGLE, DFLASH)}


def head_kind(name: str) -> HeadKind:
    """The record of the kind called `name`, or one line naming the kinds there are."""
    if name not in KINDS:
        raise UserError(f"unknown head kind {name!r}: expected one of {', '.join(KINDS)}")
    return KINDS[name]


def saved_head_kind(path: str | Path) -> HeadKind:
    """The record of a saved head's kind, from its checked metadata."""
    return head_kind(saved_kind_name(path))


def format_kind(fmt: str) -> HeadKind:
    """The kind whose export format `fmt` is (formats are checked before they get here)."""
    return next(k for k in KINDS.values() if fmt in k.formats)


def layouts() -> dict[str, Layout]:
    """Every export format of every kind, in the records' order."""
    return {fmt: layout for k in KINDS.values() for fmt, layout in k.formats.items()}


def check_export_formats(cfg: RootConfig) -> None:
    """`export.formats` against the formats there are and the chosen head's, as one line, before
    anything loads (the schema cannot: conf sits below the records)."""
    asked, known = cfg.export.formats, list(layouts())
    if asked is not None and not (asked and set(asked) <= set(known)):
        raise UserError(f"export.formats={asked}: expected null or a subset of {known}")
    if cfg.head is not None and asked:
        own = head_kind(cfg.head.name).formats
        wrong = [f for f in asked if f not in own]
        if wrong:
            raise UserError(f"export.formats={wrong}: a {cfg.head.name} head exports as {', '.join(own)}")
