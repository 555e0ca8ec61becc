"""A stand-in for the job loop behind a MasterServicer under test: one thread serving its requests.

In a job, ``Job._loop`` serves the workers' requests at its ``RequestDesk``; tests of the gRPC
edge have no job, so this thread does the loop's part (and nothing else). The test thread reads
the ledgers only between calls, once their answers came back.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.dispatcher import TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.request_desk import RequestDesk
from elasticdl.master.requests import RequestLine
from elasticdl.master.servicer import MasterServicer


def serving_loop(desk: RequestDesk, notify: Callable[[object], None] | None = None) -> RequestLine:
    """A line into a daemon thread that serves ``desk``'s requests as Job._loop does."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    notify = notify or (lambda event: None)

    def run() -> None:
        while True:
            due = desk.next_deadline()
            try:
                request = requests.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:
                desk.settle()  # a parked request's deadline
                continue
            for event in desk.serve(request):
                notify(event)
            desk.settle()

    threading.Thread(target=run, name="loop-stand-in", daemon=True).start()
    return RequestLine(requests.put)


def master_servicer(
    dispatcher: TaskDispatcher,
    progress: TrainingProgress | None = None,
    clocks: WorkerClocks | None = None,
    notify: Callable[[object], None] | None = None,
    **kwargs,
) -> MasterServicer:
    """A MasterServicer whose requests a stand-in loop serves against ``dispatcher``."""
    desk = RequestDesk(dispatcher, progress)
    return MasterServicer(serving_loop(desk, notify), clocks or WorkerClocks(), lambda: desk.active_workers, **kwargs)
