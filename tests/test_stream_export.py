"""Continuous export (--export_every_secs): versioned, whole, pruned, fresh, from one version.

The exporter runs on the test's clocks with a writer that writes a marker file (the real
SavedModel export is checked end to end in test_e2e_kafka.py); the snapshot rule runs against
a fake PS whose shards are at different versions until they are not.
"""

from __future__ import annotations

import os

import pytest

from elasticdl.data.sources import Shard
from elasticdl.master.stream_export import (
    EXPORT_SNAPSHOT_ID,
    Capture,
    ContinuousExport,
    capture_ledger,
    snapshot_model,
)
from elasticdl.master.stream_tasks import StreamTaskManager


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _writer(seen: list):
    def write(model, path: str) -> str:
        final = os.path.join(os.path.dirname(path), str(model))
        # While it is written, the version's directory is not there: a server sees none of it.
        seen.append((os.path.basename(path), os.path.exists(final)))
        os.makedirs(path)
        with open(os.path.join(path, "saved_model.pb"), "w") as f:
            f.write(f"model {model}")
        return path
    return write


def _exporter(tmp_path, keep: int = 3, timestamps=None, write=None):
    clock, wall, seen = Clock(), Clock(10_000.0), []
    exporter = ContinuousExport(str(tmp_path / "out"), every_secs=5.0, keep=keep, timestamps=timestamps,
                                write=write or _writer(seen), clock=clock, wall=wall)
    return exporter, clock, wall, seen


def _versions(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "out"), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0))


def test_an_export_is_due_every_period_runs_in_the_background_and_is_renamed_into_place(tmp_path):
    asked = []
    exporter, clock, wall, seen = _exporter(
        tmp_path, timestamps=lambda offsets: asked.append(dict(offsets)) or {0: 9_990.0, 1: 9_995.5})
    capture = lambda: Capture(300, {0: 120, 1: 180})  # noqa: E731
    assert not exporter.tick(capture, lambda: (40, 40))  # not due before every_secs
    clock.now += 5.0
    wall.now = 10_001.0
    assert exporter.tick(capture, lambda: (40, 40))
    assert not exporter.tick(capture, lambda: (41, 41))  # the next one is due 5 s later
    exporter.wait()
    assert _versions(tmp_path) == ["40"]
    assert seen == [(seen[0][0], False)] and seen[0][0].startswith(".40.tmp-")  # hidden while written
    assert asked == [{0: 119, 1: 179}]  # the newest record of each partition held
    (record,) = exporter.summary()["list"]
    assert record["version"] == 40 and record["records"] == 300
    assert record["newest_offsets"] == {"0": 119, "1": 179}
    assert record["newest_record_time"] == 9_995.5 and record["freshness_secs"] == pytest.approx(5.5)
    assert exporter.summary()["median_freshness_secs"] == pytest.approx(5.5)


def test_the_newest_keep_exports_stay_and_a_version_out_already_is_not_written_again(tmp_path):
    exporter, clock, _, seen = _exporter(tmp_path, keep=3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("not an export: left alone")
    for version in (10, 20, 20, 30, 40, 50):
        exporter.export(version, version, Capture(version))
    assert _versions(tmp_path) == ["30", "40", "50", "notes.txt"]
    assert [e.version for e in exporter.exports] == [10, 20, 30, 40, 50]  # 20 once
    assert len(seen) == 5


def test_an_earlier_runs_export_of_the_same_version_is_replaced_and_a_failed_write_leaves_nothing(tmp_path):
    exporter, clock, _, seen = _exporter(tmp_path)
    old = tmp_path / "out" / "7"
    old.mkdir(parents=True)
    (old / "saved_model.pb").write_text("an earlier run's")
    exporter.export(7, 7, Capture(1))
    assert (old / "saved_model.pb").read_text() == "model 7"

    def broken(model, path):
        os.makedirs(path)
        raise OSError("disk full")

    failing, clock, _, _ = _exporter(tmp_path, write=broken)
    clock.now += 5.0
    failing.tick(lambda: Capture(1), lambda: (8, 8))
    failing.wait()
    assert failing.skipped == 1 and failing.exports == []
    assert _versions(tmp_path) == ["7"]  # no half export, no temporary left


def test_the_final_export_waits_for_the_running_one_and_is_marked_final(tmp_path):
    exporter, clock, _, _ = _exporter(tmp_path)
    clock.now += 5.0
    exporter.tick(lambda: Capture(10), lambda: (3, 3))
    path = exporter.final(4, 4, Capture(12))
    assert path == str(tmp_path / "out" / "4")
    assert [(e.version, e.final) for e in exporter.exports] == [(3, False), (4, True)]
    assert exporter.final(4, 4, Capture(12)) == path and exporter.exports[-1].final  # the same version again


class _PullResult:
    def __init__(self, version, params):
        self.version, self.params, self.initialized = version, params, True


class _PS:
    """Two shards; each snapshot finds them at the versions the test lists."""

    def __init__(self, versions: list[tuple[int, int]]):
        self.versions = versions
        self.calls = []

    def take_snapshot(self, snapshot_id):
        self.calls.append(("take", snapshot_id))

    def pull_snapshot(self, snapshot_id):
        self.calls.append(("pull", snapshot_id))
        a, b = self.versions.pop(0)
        return [_PullResult(a, {"w0": a}), _PullResult(b, {"w1": b})]

    def drop_snapshot(self, snapshot_id):
        self.calls.append(("drop", snapshot_id))

    def pull_embedding_table(self, name):
        raise AssertionError("not called by the fake trainer")


class _Trainer:
    def __init__(self):
        self.params = {}

    def set_params(self, params):
        self.params.update(params)

    def serving_model(self, fetch_table):
        return dict(self.params)


def test_an_export_snapshot_is_kept_only_with_every_ps_at_one_version_and_is_always_dropped():
    ps, trainer, pauses = _PS([(5, 6), (7, 7)]), _Trainer(), []
    assert snapshot_model(ps, trainer, pause=pauses.append) == (7, {"w0": 7, "w1": 7})
    assert ps.calls == [(c, EXPORT_SNAPSHOT_ID) for c in ("take", "pull", "drop") * 2] and len(pauses) == 1
    ps = _PS([(1, 2), (3, 4), (5, 6)])
    assert snapshot_model(ps, _Trainer(), tries=3, pause=pauses.append) is None
    assert [c for c, _ in ps.calls].count("drop") == 3


def test_capture_gives_the_records_done_and_each_partitions_newest_done_offset():
    ledger = StreamTaskManager()
    p0, p1 = "kafka://b:9092/t#0", "kafka://b:9092/t#1"
    ledger.add([Shard(p0, 0, 10), Shard(p0, 10, 20), Shard(p1, 0, 5)])
    held = {t.shard: (t, w) for w in range(3) for t in [ledger.get_task(w)]}
    for shard in (Shard(p0, 10, 20), Shard(p1, 0, 5)):
        task, worker = held[shard]
        assert ledger.report(task.task_id, worker).accepted
    assert capture_ledger(ledger) == Capture(15, {0: 20, 1: 5})  # 0-9 of partition 0 still in progress
