"""The evaluator's progress, prompt by prompt: an evaluation of 40 prompts takes many minutes, and
silence that long looks like a hang.

On a terminal (and `logging.progress` on) a tqdm bar over prompts, as the other stages show theirs.
Elsewhere (CI, a log file) a plain line every few prompts, since a bar redrawn with carriage
returns piles up in a file. The figures are pooled as eval.json pools them (ratios of sums).
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from trainer.evaluate.report import Record, fmt, task_metrics


class EvalProgress:
    """Prompts done of `total`, speculative tokens/s and the running mean acceptance length."""

    def __init__(self, total: int, bars: bool, stream: TextIO | None = None, every: int = 5):
        self.total, self.every = total, every
        self.stream = sys.stderr if stream is None else stream
        self.bar = None
        if bars and self.stream.isatty():
            self.bar = tqdm(total=total, desc="eval", unit="prompt", file=self.stream,
                            dynamic_ncols=True)

    def show(self, records: list[Record]) -> None:
        """Called after each prompt with the records so far."""
        m = task_metrics(records)
        rate, tau = fmt(m["spec_tokens_per_s"]), fmt(m["mean_acceptance_length"])
        done = len(records)
        if self.bar is not None:
            self.bar.set_postfix({"tok/s": rate, "mean acc len": tau}, refresh=False)
            self.bar.update(done - self.bar.n)
        elif done % self.every == 0 or done == self.total:
            print(f"eval: {done}/{self.total} prompts, {rate} tokens/s, mean acceptance length {tau}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
