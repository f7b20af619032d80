"""`python -m trainer.evaluate head=<path> [overrides]`: decode the evaluation prompts with and
without the head and write eval.json / eval.md / acceptance.png."""

from __future__ import annotations

import sys
from pathlib import Path

from conf.compose import split_args
from conf.errors import exit_on_user_error
from heads.folder import compose_for_head
from trainer.evaluate.run import evaluate


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    own, overrides = split_args(sys.argv[1:] if argv is None else argv, ("head",))
    head = own.get("head", "")
    cfg = compose_for_head(head, overrides)
    out_dir = Path(cfg.eval.out_dir or Path(cfg.run_dir) / "eval")
    result = evaluate(cfg, head, out_dir)
    o = result["overall"]
    print(
        f"mean acceptance length {o['mean_acceptance_length']}, speedup vs greedy "
        f"{o['speedup_vs_greedy']}, lossless {result['lossless']}: {out_dir / 'eval.md'}"
    )


if __name__ == "__main__":
    main()
