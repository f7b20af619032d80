"""`python -m heads.export head=<path> [format=<fmt>] [out=<dir>] [eval=<eval.json>] [push_to_hub=<repo>]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conf.compose import split_args
from conf.errors import UserError, exit_on_user_error
from heads.export.write import export_head, formats_for
from heads.folder import compose_for_head
from heads.kinds import check_export_formats, head_kind

OWN_KEYS = ("head", "format", "out", "eval", "push_to_hub")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    own, overrides = split_args(sys.argv[1:] if argv is None else argv, OWN_KEYS)
    head = own.get("head", "")
    cfg = compose_for_head(head, overrides)
    check_export_formats(cfg)
    asked = own["format"].split(",") if own.get("format") else None
    kind_formats = list(head_kind(cfg.head.name).formats)
    if asked and not set(asked) <= set(kind_formats):  # format= is ours, not a schema field
        raise UserError(
            f"format={own['format']}: expected one of {', '.join(kind_formats)} "
            f"(the formats of {cfg.head.name} heads)"
        )
    formats = formats_for(head, asked or cfg.export.formats)
    push = own.get("push_to_hub") or cfg.export.push_to_hub
    if push and len(formats) > 1:
        raise UserError(f"push_to_hub={push}: one repo holds one format; add format=<one of them>")
    run_dir = Path(head).resolve().parent  # trainer.train writes <run_dir>/head, eval/, export/
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
            num_speculative_tokens=cfg.eval.num_speculative_tokens,
            license=cfg.export.license,
        )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
