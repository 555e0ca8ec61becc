"""The nemesis's stream mode (issue 27): a Kafka stream job under PS, worker and master kills.

``--mode stream`` runs each seed's job on a stream: a Kafka-protocol broker of its own (Tansu,
tests/kafka_fixture.py, in memory, on a free loopback port), a 2-partition topic, and a
producer beside the job. The producer writes ``PRODUCED`` digits examples (the training files'
records, over again: each is a record of its own offset): ``FIRST`` before the job starts, then
one every ``PACE`` s until the job's first checkpoint cut (however long a loaded machine takes
to start it), then ``BATCH`` every ``PACE`` s. So the faults, which fire on cuts (a stream has no
epochs) and relaunches, come while records still arrive. The job ends ``--stream_idle_secs``
after the last record.

Checked from outside (``check_stream``), as a file job is, against what was produced and what
the PS's own files hold: the final cut's shards each applied every record produced, once; the
ledger consumed every one (the report's records done and cut, each partition cut up to what
the producer wrote); the report's ``exactly_once`` says what the files say. A failure is
allowed for the same faults as a file job's (checks.check_failure).
"""

from __future__ import annotations

import os
import random
import sys
import threading

from elasticdl.data import tfrecord
from elasticdl.data.sources import resolve_data_files
from elasticdl.model.checkpoint import complete_versions
from tests.chaos.checks import Verdict, check, reported_final_cut
from tests.chaos.modes import DIGITS, Mode, Plan
from tests.chaos.runner import Outcome
from tests.chaos.schedule import Fault

TOPIC, PARTITIONS = "chaos", 2
PRODUCED, FIRST, BATCH, PACE = 2000, 300, 40, 0.5
IDLE_SECS = 8  # --stream_idle_secs: well above the producer's pace, even on a loaded machine
# Small tasks and frequent cuts: a 2,000-record stream makes a dozen cuts for the faults to fire on.
STREAM = Mode("stream", {"stream_idle_secs": IDLE_SECS, "records_per_task": 64, "checkpoint_steps": 8},
              num_workers=2, model=DIGITS, num_ps=(1, 2))
# The faults of a stream run: the kills the issue names, and a store cut (a master replaced after
# its ledger writes failed: the simulator's seed 2210). Weights as schedule.WEIGHTS.
ANY_STORE = ("kill_ps", "kill_worker")
ETCD_ONLY = ("kill_master", "cut_store")
WEIGHTS = {"kill_ps": 4, "kill_worker": 3, "kill_master": 2, "cut_store": 2}


def stream_schedule(plan: Plan, max_faults: int = 3) -> list[Fault]:
    """The seed's faults (as schedule.schedule_for draws them): on cuts, or the relaunch after a kill."""
    rng = random.Random(f"{plan.seed}/stream-faults")
    actions = ANY_STORE + (ETCD_ONLY if plan.store == "etcd" else ())
    faults: list[Fault] = []
    for _ in range(rng.randint(1, max_faults)):
        action = rng.choices(actions, [WEIGHTS[a] for a in actions])[0]
        after_kill = bool(faults) and faults[-1].action.startswith("kill")
        trigger = rng.choice(("cut", "cut", "relaunch") if after_kill else ("cut",))
        hold = round(rng.uniform(1.0, 8.0), 1) if action == "cut_store" else 0.0
        faults.append(Fault(action, trigger, 1 if trigger == "relaunch" else rng.choice((1, 1, 2)),
                            rng.randrange(3), hold))
    return faults


def digits_records(data: str, n: int = PRODUCED) -> list[bytes]:
    """``n`` serialized examples: the training files' records, over again until there are ``n``."""
    one_pass: list[bytes] = []
    for path in resolve_data_files(os.path.join(data, "train")):
        one_pass += tfrecord.read_records(path, 0, tfrecord.count_records(path))
    return [one_pass[i % len(one_pass)] for i in range(n)]


class StreamFeed:
    """The run's broker and its producer. ``start`` before the job, ``stop`` after it."""

    def __init__(self, data: str, run_dir: str):
        self.records = digits_records(data)
        self.ckpt = os.path.join(run_dir, "ckpt")
        self.log_dir = run_dir
        self.broker = None
        self.produced = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"kafka://{self.broker.bootstrap}/{TOPIC}"

    @property
    def done(self) -> bool:
        return self.produced == len(self.records)

    def start(self) -> None:
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if tests not in sys.path:  # kafka_fixture imports etcd_fixture as pytest puts tests/ on the path
            sys.path.insert(0, tests)
        from kafka_fixture import KafkaBroker, require_broker_binary

        os.makedirs(self.log_dir, exist_ok=True)
        self.broker = KafkaBroker(require_broker_binary(), self.log_dir)
        self.broker.start()
        self.broker.create_topic(TOPIC, PARTITIONS)
        self._produce(FIRST)
        self._thread = threading.Thread(target=self._trickle, name="chaos-producer", daemon=True)
        self._thread.start()

    def _produce(self, n: int) -> None:
        batch = self.records[self.produced:self.produced + n]
        self.broker.produce(TOPIC, batch, partitions=PARTITIONS)
        self.produced += len(batch)

    def _trickle(self) -> None:
        # The producer's pace is the workload's, not a wait for an event: records arrive over time.
        while not self.done and not self._stop.is_set():
            under_way = os.path.isdir(self.ckpt) and bool(complete_versions(self.ckpt))
            self._produce(BATCH if under_way else 1)
            self._stop.wait(PACE)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.broker is not None:
            self.broker.stop()


def check_stream(plan: Plan, outcome: Outcome, run_dir: str, produced: int, producer_done: bool) -> Verdict:
    """A stream run against the records produced and the PS's files (see the module's docstring)."""
    return check(plan, outcome, run_dir, "", success=lambda report, ckpt: stream_success_problems(
        plan, report, ckpt, produced, producer_done))


def stream_success_problems(plan: Plan, report: dict, ckpt: str, produced: int, producer_done: bool) -> list[str]:
    problems = []
    if not producer_done:
        problems.append(f"the job ended idle after {produced} records, before the producer wrote them all")
    cut = reported_final_cut(report, ckpt, problems)
    if cut is None:
        return problems
    _, shards = cut
    versions = sorted({s.version for s in shards})
    if len(shards) != plan.num_ps or len(versions) != 1 or report.get("model_version") != versions[0]:
        problems.append(f"the final cut's {len(shards)} shards are at versions {versions}, the report says "
                        f"{report.get('model_version')} ({plan.num_ps} PS)")
    applied = [s.records_applied for s in shards]
    if applied != [produced] * len(shards):
        problems.append(f"the PS applied {applied} records, the producer wrote {produced}")
    once = report.get("exactly_once", {})
    if once.get("records_applied") != applied or once.get("holds") != (applied == [produced] * len(shards)):
        problems.append(f"the report's exactly_once {once} is not what the PS files hold ({applied})")
    stream = report.get("stream", {})
    # The topic is the run's own, its offsets from 0 (``start`` is where the last master started:
    # a resumed one, from the ledger's offsets).
    cut_to = sum(p.get("cut_to", 0) for p in stream.get("partitions", {}).values())
    consumed = (report.get("records_done_per_epoch"), stream.get("records_cut"), cut_to)
    if consumed != ([produced], produced, produced):
        problems.append(f"the ledger consumed (records done, cut, offsets cut) {consumed}, the producer wrote {produced}")
    return problems
