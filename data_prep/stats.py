"""`PrepStats`: what data prep counted and timed on the way from the source to the shards.

Named fields, not string keys: a misspelt count is an AttributeError where it is written, not a
new key that its reader (the summary line, the time budget's planner) silently reads as 0. The
manifest stores `as_dict()`, so readers of a folder see the same names as the code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Count names the summary line shows (those that are not zero): what was skipped or cut.
_SHOWN = ("skipped", "trunc", "turns", "answers", "conversations")


@dataclass
class PrepStats:
    rows: int = 0  # source rows read
    skipped_no_prompt: int = 0  # conversations without a user turn (regeneration)
    skipped_no_assistant: int = 0  # conversations without an assistant turn (as they are)
    skipped_prompt_too_long: int = 0  # no room left for a whole answer within max_length
    skipped_no_assistant_token: int = 0  # rows whose supervised tokens were all cut
    conversations_refused_by_template: int = 0
    assistant_turns: int = 0  # in the conversations used as they are
    turns_split_in_text: int = 0  # located on text: one token straddles the turn's start
    turns_raw_text: int = 0  # the template drops part of the turn: trained on its raw text
    turns_dropped_unaligned: int = 0
    turns_dropped_empty: int = 0
    turns_dropped_refused: int = 0
    turns_dropped_too_long: int = 0  # regeneration: no room for an answer to a later turn
    truncated: int = 0  # rows cut at max_length
    answers_cut_at_max_new_tokens: int = 0
    regenerated_from_cache: int = 0  # answers the regeneration cache held already
    regenerated_tokens: int = 0  # new tokens the target wrote in this build
    regenerate_seconds: float = 0.0  # the time it took
    # The hf engine's decode-step cost fitted from this build's steps (`regen_cost.StepCost`'s
    # fields), which the time budget replays for the run's regeneration; None: no engine steps
    # (all cached, another backend).
    regenerate_step_cost: dict | None = None

    def dropped_turns(self) -> int:
        """Assistant turns of conversations used as they are that could not be trained."""
        return self.turns_dropped_unaligned + self.turns_dropped_empty + self.turns_dropped_refused

    def drop_counts(self) -> dict[str, int]:
        """The non-zero drop counts behind `dropped_turns`, by reason."""
        drops = ("turns_dropped_unaligned", "turns_dropped_empty", "turns_dropped_refused")
        return {k: v for k, v in self.nonzero().items() if k in drops}

    def nonzero(self) -> dict:
        return {k: v for k, v in self.as_dict().items() if v}

    def shown(self) -> dict[str, int]:
        """The non-zero skip, cut and drop counts, for the summary line."""
        return {k: v for k, v in self.nonzero().items() if k.startswith(_SHOWN)}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
