"""The catalog of head kinds: `KINDS` lists each kind's record (`heads.record.HeadKind`), by name.

A record holds everything the rest of the code asks about a kind. Data prep asks which layers to
capture, whether there is a draft vocabulary and whether to keep the target's top-1 id per token
(a teacher over a draft vocabulary needs it); the evaluator asks how the head is usually served
and how to load it for decoding; export asks its formats, their layouts, the self-check and the
model card's title and serve commands (the trainer's half, the trainee and the drafter, is listed
by `trainer.kinds.CATALOG`). Each answer is a field of the record, so no module outside a kind's
own branches on the kind's name (`tests/unit/test_kind_branches.py` holds the line).

A kind is one folder per layer. A new kind (DSpark, ...) supplies:
- its config class in `conf/kinds.py` (its `name` default is the kind's name; a derived kind
  subclasses its parent's) with the YAML group `conf/head/<name>.yaml` (its `/kinds/<name>`
  defaults entry and the knobs a user tunes), listed in `conf.kinds.HEAD_CONFIGS`: the schema
  stays in conf, which cannot import heads;
- `heads/<name>/`: `model.py` (the head module, `kind = <name>`, `save_pretrained` /
  `from_pretrained`, `captured_layers`, `load_for_decoding`), `export.py` (its formats' `Layout`s,
  the self-check's `KindOps`, `serve_lines`, and `card_facts` / `served_tokens` / `engine_keys`
  where the record's defaults do not fit: vLLM serves a P-EAGLE folder as method "eagle3" with
  parallel drafting), and `__init__.py` building its record, `KIND`; what kinds share is in
  `heads.parts` and `heads.export` (core, check, card, write), never in another kind's folder,
  except a derived kind's parent (P-EAGLE reads EAGLE-3's);
- `trainer/kinds/<name>.py`: the trainee and drafter builders (the decoding drafter in
  `trainer/decoding/`);
- one line here, in `KINDS`, and one in `trainer.kinds.CATALOG`.

Layering: conf <- heads <- data_prep <- trainer. The record sits in heads, so it holds heads'
objects (config classes, layouts, checks, card text) directly and answers data prep with plain
values (`captured_layers` gives layer ids; `data_prep.prepare.capture_spec` wraps them in its
`CaptureSpec`). `heads.export.write` reads this catalog; the records read only the shared parts
of `heads.export` (`core`, `check`, `card`), so no import closes a loop.
"""

from __future__ import annotations

from pathlib import Path

from conf.errors import UserError
from conf.schema import RootConfig
from heads import dflash, dspark, eagle3, medusa, mtp, peagle
from heads.export.core import Layout
from heads.folder import head_kind as saved_kind_name
from heads.record import HeadKind

KINDS: dict[str, HeadKind] = {
    k.name: k for k in (eagle3.KIND, medusa.KIND, peagle.KIND, dflash.KIND, dspark.KIND, mtp.KIND)
}


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


def check_export_formats(cfg: RootConfig) -> HeadKind | None:
    """`export.formats` against the formats there are and the chosen head's, as one line, before
    anything loads (the schema cannot: conf sits below the records); the chosen head's record
    (None: no head chosen), so that a command resolves its kind once, here."""
    asked, known = cfg.export.formats, list(layouts())
    if asked is not None and not (asked and set(asked) <= set(known)):
        raise UserError(f"export.formats={asked}: expected null or a subset of {known}")
    kind = None if cfg.head is None else head_kind(cfg.head.name)
    if kind is not None and asked:
        own = kind.formats
        wrong = [f for f in asked if f not in own]
        if wrong:
            raise UserError(f"export.formats={wrong}: a {cfg.head.name} head exports as {', '.join(own)}")
        for fmt in asked:
            refuses = own[fmt].refuses
            reason = refuses and refuses(vars(cfg.head), None)
            if reason:
                raise UserError(f"export.formats={fmt}: {reason}")
    return kind
