"""Continuous export for serving (--export_every_secs): versioned SavedModels while a stream trains.

Every ``--export_every_secs`` the job loop hands an export to a thread of its own (one at a
time; the loop never waits for TensorFlow):

1. on the loop's thread, what the ledger holds done then (``Capture``): the records, and per
   partition the newest offset of a task done. Every push of a done task was applied before
   it was reported, so the snapshot taken after holds at least those records;
2. a snapshot of every PS (``take_snapshot``), kept only when every PS froze the same model
   version (tried again a few times: an update may be between two PS), its parameters
   loaded into the master's model;
3. the SavedModel written to ``OUTPUT/.<version>.tmp-<n>`` and renamed to ``OUTPUT/<version>/``:
   TensorFlow Serving's versioned layout, and a server that polls ``OUTPUT`` never sees half
   of one. A version already exported is not written again (nothing trained since);
4. the oldest beyond ``--keep_exports`` removed (newest kept), and the export listed with its
   freshness: the seconds from the Kafka timestamp of the newest record it holds to the
   export's completion.

The job's final export goes the same way (``final``, after the running one finished), so a
stream job with --export_every_secs ends with its last model in ``OUTPUT/<version>/`` too.
Embedding tables (elasticdl.layers.Embedding) are pulled live, not from the snapshot: their
rows may be a little newer than the dense parameters (docs/online_training.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# The snapshot id of exports: far above the evaluation rounds' (numbered from 1).
EXPORT_SNAPSHOT_ID = 1 << 40
# How many snapshots an export takes at most to find every PS at one version.
SNAPSHOT_TRIES = 5
_SNAPSHOT_RETRY_SECS = 0.05  # an update between two PS takes milliseconds


@dataclass(frozen=True)
class Capture:
    """What the ledger held done just before a snapshot: records, and per partition one past the
    newest offset of a done task."""

    records: int
    newest: dict[int, int] = field(default_factory=dict)


@dataclass
class ExportRecord:
    version: int
    path: str
    records: int  # records done when its snapshot was taken: at least these are in it
    newest_offsets: dict[str, int]  # partition -> the newest offset it holds (of a task done)
    newest_record_time: float | None  # that record's Kafka timestamp (epoch seconds), newest over partitions
    completed_at: float  # epoch seconds
    freshness_secs: float | None  # completed_at - newest_record_time
    seconds: float  # how long the export took
    final: bool = False


class ContinuousExport:
    """``tick`` from the job loop; ``final`` at the end; ``summary`` for the report."""

    def __init__(self, output: str, every_secs: float, keep: int,
                 timestamps: Callable[[Mapping[int, int]], dict[int, float]] | None = None,
                 write: Callable[[Any, str], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.output = output
        self.every_secs = every_secs
        self.keep = keep
        self._timestamps = timestamps or (lambda offsets: {})
        self._write = write or _export_saved_model
        self._clock = clock
        self._wall = wall
        self._due = clock() + every_secs
        self._thread: threading.Thread | None = None
        self._names = itertools.count()
        self._lock = threading.Lock()  # one export at a time (the final one waits for a running one)
        self.exports: list[ExportRecord] = []
        self.skipped = 0  # exports given up (no snapshot at one version, a write that failed)

    # ------------------------------------------------------------ the job loop

    def tick(self, capture: Callable[[], Capture], snapshot: Callable[[], tuple[int, Any] | None]) -> bool:
        """When an export is due and none runs: capture the ledger now, export in the background.
        True: one was started."""
        now = self._clock()
        if now < self._due or (self._thread is not None and self._thread.is_alive()):
            return False
        self._due = now + self.every_secs
        captured = capture()
        if not captured.records:
            return False  # nothing trained yet: no model worth serving
        self._thread = threading.Thread(target=self._background, args=(captured, snapshot),
                                        name="stream-export", daemon=True)
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Until the export running in the background is over."""
        if self._thread is not None:
            self._thread.join(timeout)

    def final(self, model: Any, version: int, captured: Capture) -> str:
        """The job's last export (after the one running): its path. Errors are raised (the job fails)."""
        self.wait()
        record = self.export(model, version, captured, final=True)
        return record.path

    def summary(self) -> dict:
        """The report's ``exports``: each export, and the median and largest freshness."""
        fresh = [e.freshness_secs for e in self.exports if e.freshness_secs is not None]
        return {
            "output": self.output, "every_secs": self.every_secs, "keep": self.keep, "skipped": self.skipped,
            "median_freshness_secs": statistics.median(fresh) if fresh else None,
            "max_freshness_secs": max(fresh) if fresh else None,
            "list": [asdict(e) for e in self.exports],
        }

    # ------------------------------------------------------------ one export

    def _background(self, captured: Capture, snapshot: Callable[[], tuple[int, Any] | None]) -> None:
        try:
            with self._lock:
                taken = snapshot()
                if taken is None:
                    self.skipped += 1
                    logger.warning("no export this time: the parameter servers were never at one version in "
                                   "%d snapshots, or one holds no model (the next export tries again)",
                                   SNAPSHOT_TRIES)
                    return
                version, model = taken
                self._export_locked(model, version, captured, final=False)
        except Exception as err:  # an export that fails leaves training alone; the next one tries again
            self.skipped += 1
            logger.warning("the export to %s failed (%s: %s); the next one tries again", self.output,
                           type(err).__name__, err)

    def export(self, model: Any, version: int, captured: Capture, final: bool = False) -> ExportRecord:
        with self._lock:
            return self._export_locked(model, version, captured, final)

    def _export_locked(self, model: Any, version: int, captured: Capture, final: bool) -> ExportRecord:
        started = self._clock()
        path = os.path.join(self.output, str(version))
        known = next((e for e in self.exports if e.version == version), None)
        if known is not None and os.path.isdir(path):  # this version is out already: nothing trained since
            known.final = known.final or final
            return known
        os.makedirs(self.output, exist_ok=True)
        tmp = os.path.join(self.output, f".{version}.tmp-{os.getpid()}-{next(self._names)}")
        old = tmp.replace(".tmp-", ".old-")
        try:
            self._write(model, tmp)
            if os.path.isdir(path):  # an earlier run's export of this version number: replaced
                os.rename(path, old)
            os.rename(tmp, path)  # whole, or not there: a server never sees half of it
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
        times = self._timestamps({p: o - 1 for p, o in captured.newest.items() if o > 0})
        newest = max(times.values(), default=None)
        done = self._wall()
        record = ExportRecord(version, path, captured.records, {str(p): o - 1 for p, o in captured.newest.items()},
                              newest, done, None if newest is None else max(0.0, done - newest),
                              self._clock() - started, final)
        self.exports.append(record)
        self._prune()
        fresh = "" if record.freshness_secs is None else f", {record.freshness_secs:.1f} s after its newest record"
        logger.info("exported model version %d (%d records) to %s%s", version, record.records, path, fresh)
        return record

    def _prune(self) -> None:
        """Keep the newest ``keep`` versions in OUTPUT (what else is there is not ours: left alone)."""
        versions = sorted(int(n) for n in os.listdir(self.output) if n.isdigit()
                          and os.path.isdir(os.path.join(self.output, n)))
        for version in versions[:-self.keep]:
            shutil.rmtree(os.path.join(self.output, str(version)), ignore_errors=True)
            logger.info("removed export %d (--keep_exports %d)", version, self.keep)


def _export_saved_model(model: Any, path: str) -> str:
    from elasticdl.model.export import export_saved_model

    return export_saved_model(model, path)


# ------------------------------------------------------------ the job's side


def capture_ledger(ledger) -> Capture:
    """What a stream ledger holds done now (the job loop's thread)."""
    from elasticdl.data.kafka_address import parse_partition_path

    newest = {parse_partition_path(path)[1]: end for path, end in ledger.newest_done().items()}
    return Capture(ledger.records_done, newest)


def snapshot_model(ps, trainer, tries: int = SNAPSHOT_TRIES,
                   pause: Callable[[float], None] = time.sleep) -> tuple[int, Any] | None:
    """(version, the serving model) from one snapshot with every PS at the same version, loaded
    into ``trainer``; None when ``tries`` snapshots all found the PS at different versions."""
    for attempt in range(tries):
        ps.take_snapshot(EXPORT_SNAPSHOT_ID)
        try:
            pulled = ps.pull_snapshot(EXPORT_SNAPSHOT_ID)
        finally:
            ps.drop_snapshot(EXPORT_SNAPSHOT_ID)
        versions = {p.version for p in pulled}
        if not all(p.initialized for p in pulled):
            return None  # a PS restarted empty and waits for a worker's model: nothing to serve from it
        if len(versions) == 1:
            for part in pulled:
                trainer.set_params(part.params)
            return versions.pop(), trainer.serving_model(ps.pull_embedding_table)
        if attempt + 1 < tries:
            pause(_SNAPSHOT_RETRY_SECS)  # a background thread's pause: an update is between two PS
    return None


def continuous_export(config, topic=None) -> ContinuousExport | None:
    """The job's exporter (--export_every_secs), or None when off."""
    stream = config.stream
    if not stream.export_every_secs:
        return None
    return ContinuousExport(config.outputs.output, stream.export_every_secs, stream.keep_exports,
                            timestamps=None if topic is None else topic.timestamps)
