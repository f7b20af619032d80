"""Work done ahead of its consumer on a background thread: in order, a bounded number ahead.

Online training fed by servers (`data_prep.folders.online_engine`) asks the serving engine for each
batch's hidden states; asked when the step needs them, every step would wait a round trip and
the engine's forward. Here a thread takes the next batches and asks for theirs while the trainer
trains on the current one. Bounded (`depth`), because each batch's states are large (at 8B,
64 MB in float32 per 1,024 tokens) and a consumer that stops early (the last step, an error)
should not have made the servers compute many batches for nothing. A failure in the work (a
server gone) reaches the consumer at the item it concerns, raised on the consumer's thread as
it was raised, so the items before it are all used and nothing is skipped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")

JOIN_S = 30.0  # how long a closed consumer waits for the item in the thread's hands to finish
_END = object()


@dataclass
class _Failed:
    error: BaseException


def prefetched(items: Iterable[T], work: Callable[[T], U], depth: int) -> Iterator[tuple[T, U]]:
    """(item, work(item)) for each item in order, `work` running on a background thread at most
    `depth` items ahead of the consumer (taken from `items` and not yet handed over). An
    exception in `work` or in `items` is raised here, after every item before it. Closing the
    iterator (or the consumer raising) stops the thread before it takes another item; the one
    it holds, if any, is finished first (up to `JOIN_S`), so no request is left half read."""
    if depth < 1:
        raise ValueError(f"depth={depth}: expected >= 1")
    out: queue.Queue = queue.Queue()
    slots = threading.Semaphore(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            source = iter(items)
            while True:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                item = next(source, _END)
                if item is _END:
                    break
                out.put((item, work(item)))
        except BaseException as err:  # noqa: BLE001 - every failure goes to the consumer
            out.put(_Failed(err))
            return
        out.put(_END)

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while (got := out.get()) is not _END:
            if isinstance(got, _Failed):
                raise got.error
            slots.release()
            yield got
    finally:
        stop.set()
        thread.join(JOIN_S)
