"""One exception type for mistakes the user can fix, so every entry point reports them alike."""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """Bad input (a config value, a file, a field): printed as one line, exit code 2."""


def exit_on_user_error(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn a `UserError` into one line on stderr and exit code 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            _close_progress_bars()
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def _close_progress_bars() -> None:
    """A stage that fails leaves its progress bar open, and an open bar redraws itself when the
    interpreter exits, after the error line; closed first, the error is the last line shown."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):  # tqdm's own registry of open bars
        bar.close()


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (library errors run to pages), or its type."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def no_such_key(key: str, known: Iterable[str]) -> UserError:
    """`key: no such key; closest: ...`: a typo (`optim.lrr`) or a key under the wrong group
    (`lr=`) names what was meant, where Hydra says only "Could not override". Close spellings of
    the whole key first, else keys whose last part is spelled alike (`tempreature`)."""
    known = list(known)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    if not close:
        last = key.rpartition(".")[2]
        by_last: dict[str, list[str]] = {}
        for k in known:
            by_last.setdefault(k.rpartition(".")[2], []).append(k)
        near = difflib.get_close_matches(last, list(by_last), n=3, cutoff=0.75)
        close = [k for name in near for k in by_last[name]][:4]
    hint = f"closest: {', '.join(close)}" if close else "--help lists the keys"
    return UserError(f"{key}: no such key; {hint}")
