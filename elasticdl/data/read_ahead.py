"""Read ahead: the next item of an iterator fetched in a thread while the caller uses this one.

A reader that alternates between waiting on the network (a row group's ranged reads) and
converting what arrived keeps one item in flight: the thread takes item i + 1 from the
source while the caller works on item i. At most one item is held ahead, so memory stays
one row group above a plain read. Items come in the source's order, and an error the source
raises reaches the caller unchanged, where a direct read would have raised it: after the
items before it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def read_ahead(source: Iterable[T]) -> Iterator[T]:
    """The items of ``source``, each fetched while the caller holds the one before."""
    items = iter(source)
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def hand(item) -> bool:
        """Put ``item`` for the caller; False once the caller has left."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)  # wakes to notice a caller that left
                return True
            except queue.Full:
                continue
        return False

    def fetch() -> None:
        try:
            for item in items:
                if not hand(item):
                    return
            hand(_DONE)
        except BaseException as err:  # handed to the caller, which raises it
            hand(_Failed(err))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator left early ends here, in the thread that ran it

    thread = threading.Thread(target=fetch, name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        try:  # make room, in case the thread waits to hand over an item
            ready.get_nowait()
        except queue.Empty:
            pass
        thread.join()  # it ends after the item it is fetching: the source's resources are free after this
