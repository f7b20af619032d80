"""`python -m heads.export head=<path> [format=<fmt>] [out=<dir>] [eval=<eval.json>] [push_to_hub=<repo>]`.

`head` is any folder `trainer.evaluate` reads (`heads.formats`): a run's head, or an engine's
export (ours or another tool's), read against its target's config (the one its config names, or
`target.name_or_path=`), so one format is turned into another through the same checks."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from conf.compose import print_help, split_args
from conf.errors import UserError, exit_on_user_error
from conf.schema import RootConfig
from conf.usage import wants_help
from heads.export.write import export_head, formats_for
from heads.formats import (
    DRAFTSMITH,
    compose_for_any_head,
    folder_format,
    load_target_config,
    read_any_head,
    save_as_own,
)
from heads.kinds import check_export_formats

OWN_KEYS = ("head", "format", "out", "eval", "push_to_hub")
USAGE = "python -m heads.export head=<path> [format=<fmt>] [out=<dir>] [eval=<json>] [push_to_hub=<repo>]"
# --help: each own key's default and meaning, and the config keys export reads.
OWN_HELP = (
    ("head", "<path>", "the head folder: a run's <run_dir>/head, or an engine's export (required)"),
    ("format", "<export.formats>", "one format of the head's kind (eagle3, speculators, medusa-vllm, ...)"),
    ("out", "<export.out_dir>", "where the exports go (null: <run_dir>/export), a folder per format"),
    ("eval", "<run_dir>/eval/eval.json", "the evaluation the model card reports (where it exists)"),
    ("push_to_hub", "<export.push_to_hub>", "a Hub repo id to upload one format's export to"),
)
SHOWS = ("export", "eval.num_speculative_tokens")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        overrides = [a for a in argv if a.partition("=")[0] not in OWN_KEYS]
        print_help(USAGE, "Write a trained head in its kind's engine formats, each checked.", overrides,
                   SHOWS, OWN_HELP)
        return
    own, overrides = split_args(argv, OWN_KEYS)
    head = own.get("head", "")
    cfg = compose_for_any_head(head, overrides)
    kind = check_export_formats(cfg)
    asked = own["format"].split(",") if own.get("format") else None
    kind_formats = list(kind.formats)
    if asked and not set(asked) <= set(kind_formats):  # format= is ours, not a schema field
        raise UserError(
            f"format={own['format']}: expected one of {', '.join(kind_formats)} "
            f"(the formats of {cfg.head.name} heads)"
        )
    if folder_format(head) == DRAFTSMITH:
        export(head, asked, own, cfg)
        return
    # An engine's folder: read as `trainer.evaluate` reads it, then exported as a run's head is.
    read = read_any_head(head, load_target_config(cfg), cfg.target.name_or_path)
    with tempfile.TemporaryDirectory() as tmp:
        export(str(save_as_own(read, Path(tmp) / "head")), asked, own, cfg, Path(head).resolve().parent)


def export(head: str, asked: list[str] | None, own: dict[str, str], cfg: RootConfig,
           run_dir: Path | None = None) -> None:
    """The `asked` formats (None: `export.formats`, else the head's defaults) of the draftsmith
    head folder `head`, a line of JSON each. `run_dir`: where out/ and eval.json default to
    (None: the run around `head`)."""
    formats = formats_for(head, asked or cfg.export.formats)
    push = own.get("push_to_hub") or cfg.export.push_to_hub
    if push and len(formats) > 1:
        raise UserError(f"push_to_hub={push}: one repo holds one format; add format=<one of them>")
    run_dir = run_dir or Path(head).resolve().parent  # trainer.train writes <run_dir>/head, eval/, export/
    root = Path(own.get("out") or cfg.export.out_dir or run_dir / "export")
    default_eval = run_dir / "eval" / "eval.json"
    eval_json = own.get("eval") or (default_eval if default_eval.exists() else None)
    for fmt in formats:
        out = root if own.get("out") and len(formats) == 1 else root / fmt
        _, result = export_head(
            head,
            fmt,
            out,
            eval_json=eval_json,
            push_to_hub=push,
            dtype=cfg.export.dtype,
            gguf_type=cfg.export.gguf_type,
            num_speculative_tokens=cfg.eval.num_speculative_tokens,
            license=cfg.export.license,
        )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
