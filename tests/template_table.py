"""`python -m tests.template_table [n=200]`: the eleven published chat templates over n ShareGPT
conversations (all turns; every other one opening with a system message) given synthetic inline
reasoning, through the data path that trains on
conversations as they are (`data_prep.conversations.rows.iter_rows`). One JSON line per template:
conversations in, rows out, turns by what happened to them, supervised tokens. Needs
`../shared/chat-templates/` and the packaged ShareGPT set."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from conf.errors import UserError
from conf.schema import DataConfig, RegenerateConfig
from data_prep.conversations.rows import iter_rows
from data_prep.conversations.sources import iter_jsonl, iter_samples, sharegpt_jsonl
from data_prep.stats import PrepStats
from tests.support.templates import FAMILIES, family


def with_reasoning(row: dict, system: bool) -> dict:
    """Each assistant turn gets an inline `<think>` block naming the question it answers; with
    `system`, the conversation opens with a system message."""
    turns, question = [{"from": "system", "value": "You are a helpful assistant."}] if system else [], ""
    for t in row["conversations"]:
        if t.get("from") in ("human", "user"):
            question = str(t.get("value", ""))[:80]
        elif t.get("from") in ("gpt", "assistant"):
            think = f"<think>\nThe user asks: {question}\nI answer briefly.\n</think>\n\n"
            t = {**t, "value": think + str(t.get("value", ""))}
        turns.append(t)
    return {"conversations": turns}


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "reasoning.jsonl"
        with open(src, "w") as fh:
            kept = 0
            for _, _, row in iter_jsonl(sharegpt_jsonl()):
                if kept == n:
                    break
                fh.write(json.dumps(with_reasoning(row, system=kept % 2 == 0)) + "\n")
                kept += 1
        cfg = DataConfig(source=str(src), max_samples=0, max_turns=0, max_length=2048,
                         regenerate=RegenerateConfig(enabled=False))
        for name in sorted(FAMILIES):
            tpl, stats = family(name), PrepStats()
            samples, rows, error = list(iter_samples(cfg, stats)), [], None
            try:
                rows = list(iter_rows(samples, tpl, cfg.max_length, stats))
            except UserError as err:  # most turns dropped: prepare stops with this line
                error = str(err)
            print(json.dumps({
                "template": name,
                "conversations": len(samples),
                "rows": len(rows),
                "assistant_turns": stats.assistant_turns,
                "conversations_refused": stats.conversations_refused_by_template,
                "turns_dropped": {k: v for k, v in stats.nonzero().items() if k.startswith("turns_dropped")},
                "turns_raw_text": stats.turns_raw_text,
                "turns_split_in_text": stats.turns_split_in_text,
                "supervised_tokens": sum(sum(t.loss_mask) for _, t in rows),
                "tokens": sum(len(t.input_ids) for _, t in rows),
                "error": error,
            }), flush=True)


if __name__ == "__main__":
    main(int(dict(a.split("=", 1) for a in sys.argv[1:]).get("n", 200)))
