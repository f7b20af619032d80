"""What every config dataclass checks its values with: the `Checked` mixin and its helpers.

Both `conf.schema` (the groups) and `conf.kinds` (the head kinds) build on it; it imports neither,
so the two never import each other in a circle (`conf.schema` imports `conf.kinds`, not back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from conf.errors import UserError

# A draft attention window's least length (`head.sliding_window`, `eval.sliding_window`).
MIN_WINDOW = 16


class Checked:
    """Mixin: `__post_init__` runs `check()`; `_require` names the override as a user types it."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:  # pragma: no cover - every schema class overrides it
        raise NotImplementedError

    def _key(self, name: str) -> str:
        return f"{self.PREFIX}.{name}" if self.PREFIX else name

    def _require(self, name: str, ok: Callable[[Any], bool], expected: str) -> None:
        value = getattr(self, name)
        if not ok(value):
            shown = repr(value) if isinstance(value, str) else value
            raise UserError(f"{self._key(name)}={shown}: expected {expected}")

    def _at_least(self, minimum: int | float, *names: str) -> None:
        for name in names:
            self._require(name, lambda v: v >= minimum, f"a number >= {minimum}")

    def _one_of(self, name: str, choices: tuple[str, ...]) -> None:
        self._require(name, lambda v: v in choices, f"one of {', '.join(choices)}")

    def _window(self, *steps: str) -> None:
        """`sliding_window` (`heads.window`): null, or a length that holds each of `steps` (the
        fields counting a draft's own positions: one outside the window would not see its own)."""
        window = self.sliding_window
        self._require("sliding_window", lambda v: v is None or (isinstance(v, int) and v >= MIN_WINDOW),
                      f"null or a number of positions >= {MIN_WINDOW}")
        for name in steps:
            self._require(name, lambda v: window is None or v < window,
                          f"below {self._key('sliding_window')}={window}")

    def _optional_positive(self, *names: str) -> None:
        for name in names:
            self._require(name, lambda v: v is None or v >= 1, "null or an integer >= 1")


def probability(v: float) -> bool:
    """A value in (0, 1]."""
    return 0 < v <= 1
