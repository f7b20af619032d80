"""`python -m trainer.evaluate head=<path> [overrides]`: decode the evaluation prompts with and
without the head and write eval.json / eval.md / acceptance.png. `head` is a head folder of any
format draftsmith reads (`heads.formats`): its own, or an engine's (a speculators or native
EAGLE-3 folder, Medusa's), with `target.name_or_path=` where the folder names no target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conf.compose import print_help, split_args
from conf.errors import exit_on_user_error
from conf.usage import wants_help
from heads.formats import compose_for_any_head
from trainer.evaluate.run import evaluate

USAGE = "python -m trainer.evaluate head=<path> [key=value ...]"
OWN = (("head", "<path>", "the head folder: a run's <run_dir>/head, or an engine's export (required)"),)
# The config keys evaluation reads: its target (the head's own unless overridden), the prompts'
# rendering, where eval.json goes and the sampling seed.
SHOWS = ("target", "eval", "data.chat_template", "data.chat_template_kwargs", "data.template_date",
         "seed", "run_dir", "logging.progress")


def kept_validation_of(head: str) -> dict | None:
    """A run's kept head's validation figures (summary.json's `kept_validation`) where `head` is
    the head that run kept, so eval.md reports its train-versus-serve gap evaluated again too;
    None for any other folder."""
    try:
        record = json.loads((Path(head).parent / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if Path(record.get("head_dir", "")).resolve() != Path(head).resolve():
        return None
    return record.get("kept_validation")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print_help(USAGE, __doc__, [a for a in argv if not a.startswith("head=")], SHOWS, OWN)
        return
    own, overrides = split_args(argv, ("head",))
    head = own.get("head", "")
    cfg = compose_for_any_head(head, overrides)
    out_dir = Path(cfg.eval.out_dir or Path(cfg.run_dir) / "eval")
    result = evaluate(cfg, head, out_dir, kept=kept_validation_of(head))
    o = result["overall"]
    print(
        f"mean acceptance length {o['mean_acceptance_length']}, speedup vs greedy "
        f"{o['speedup_vs_greedy']}, lossless {result['lossless']}: {out_dir / 'eval.md'}"
    )


if __name__ == "__main__":
    main()
