"""The ledger snapshot (elasticdl/store/ledger.py): a value type and its wire format."""

from __future__ import annotations

import random

import pytest
from store_helpers import snap

from elasticdl.store.ledger import (
    LedgerFormatError,
    LedgerSnapshot,
    TaskState,
    decode_rng_state,
    encode_rng_state,
)


def test_snapshot_round_trips_through_json_and_bytes():
    s = snap(7, tasks=9, shuffle_state=encode_rng_state(random.Random(3).getstate()))
    assert LedgerSnapshot.from_json(s.to_json()) == s
    assert LedgerSnapshot.from_bytes(s.to_bytes()) == s
    rng = random.Random()
    rng.setstate(decode_rng_state(LedgerSnapshot.from_bytes(s.to_bytes()).shuffle_state))
    assert rng.random() == random.Random(3).random()


def test_requeue_in_flight_puts_doing_tasks_first_in_todo():
    s = snap(3, tasks=8)
    resumed = s.requeue_in_flight()
    assert not resumed.in_state(TaskState.DOING)
    todo = resumed.in_state(TaskState.TODO)
    assert [t.task_id for t in todo] == [1, 5, 2, 6]  # the in-flight ones first, then the queue
    assert all(t.worker_id == -1 for t in todo)
    assert [t.retries for t in todo[:2]] == [s.tasks[1].retries, s.tasks[5].retries]
    assert resumed.in_state(TaskState.DONE) == s.in_state(TaskState.DONE)
    assert resumed.seq == s.seq and resumed.next().seq == s.seq + 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "not JSON"),
        ('{"format": 99}', "format 99 is not supported"),
        ('{"format": 1, "seq": 1}', "malformed ledger snapshot"),
    ],
)
def test_bad_ledger_data_is_refused_with_a_reason(text, message):
    with pytest.raises(LedgerFormatError, match=message):
        LedgerSnapshot.from_json(text)


def test_a_task_with_an_unknown_state_is_refused():
    d = snap(1).to_dict()
    d["tasks"][0][6] = "lost"
    with pytest.raises(LedgerFormatError, match="'lost'"):
        LedgerSnapshot.from_dict(d)
