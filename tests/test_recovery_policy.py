"""The recovery policy: what the job does when a PS is lost, decided from the facts alone.

Table-driven: every combination of checkpoints kept or not, a training ledger or not, and the
cuts found on disk (none, damaged, partial counts, verified, several) has one plan."""

from __future__ import annotations

import pytest

from elasticdl.master.recovery_policy import (
    CutFound,
    KeepLedger,
    PSLossFacts,
    RefillEmpty,
    RestoreCut,
    ResumeFacts,
    StartOver,
    plan_ps_loss,
    plan_resume,
    possibly_missing,
    records_between_pulls,
)

GOOD_20 = CutFound("ck/version-20", 20, True, {3: 128}, (640, 640))
GOOD_40 = CutFound("ck/version-40", 40, True, {5: 256}, (1280, 1280))
DAMAGED_60 = CutFound("ck/version-60", 60, False)
ONE_COUNT_80 = CutFound("ck/version-80", 80, True, {}, (2560,))  # a cut of a 1-PS layout: not this job's


def facts(cuts=(), checkpoint_dir=True, trains=True, dead=1, num_ps=2) -> PSLossFacts:
    return PSLossFacts(dead=dead, num_ps=num_ps, checkpoint_dir=checkpoint_dir, trains=trains,
                       cuts=tuple(cuts), missing_without_cut=64)


@pytest.mark.parametrize("case, expected", [
    # No --checkpoint_dir: the dead PS is refilled from a worker's copy, the estimate counted.
    (facts(checkpoint_dir=False), RefillEmpty(1, 64)),
    (facts([GOOD_20], checkpoint_dir=False), RefillEmpty(1, 64)),
    # evaluate / predict: no ledger to rewind; the PS just comes back.
    (facts([GOOD_20], trains=False), RefillEmpty(1, 64)),
    # The newest verified cut, the survivors rolled back to it.
    (facts([GOOD_40, GOOD_20]), RestoreCut(1, GOOD_40, (0,))),
    (facts([GOOD_40], dead=0, num_ps=2), RestoreCut(0, GOOD_40, (1,))),
    # A damaged newest cut falls back to the previous complete one.
    (facts([DAMAGED_60, GOOD_20]), RestoreCut(1, GOOD_20, (0,))),
    # A cut without one count per shard cannot say what each shard holds: passed over.
    (facts([ONE_COUNT_80, GOOD_40]), RestoreCut(1, GOOD_40, (0,))),
    # Checkpoints kept but none usable (seed 48: the only cut damaged; or none written yet):
    # every PS starts over at version 0, the ledger back to the start.
    (facts([DAMAGED_60]), StartOver(1, (0, 1), (0, 0))),
    (facts([]), StartOver(1, (0, 1), (0, 0))),
    (facts([ONE_COUNT_80]), StartOver(1, (0, 1), (0, 0))),
    (facts([], dead=0, num_ps=1), StartOver(0, (0,), (0,))),
    (facts([DAMAGED_60], dead=2, num_ps=3), StartOver(2, (0, 1, 2), (0, 0, 0))),
])
def test_the_plan_for_a_lost_ps(case, expected):
    assert plan_ps_loss(case) == expected


def test_a_restored_cut_gives_the_ledger_its_data_position_and_each_shards_count():
    plan = plan_ps_loss(facts([GOOD_40]))
    assert (plan.version, plan.marks, plan.held) == (40, {5: 256}, (1280, 1280))


def test_starting_over_rewinds_the_ledger_to_every_tasks_start_and_holds_nothing():
    plan = plan_ps_loss(facts([DAMAGED_60]))
    assert (plan.version, plan.marks, plan.held) == (0, {}, (0, 0))


@pytest.mark.parametrize("credited, held, missing", [
    (1000, (1000, 1000), 0),  # every shard holds what the ledger counts
    (1000, (1000, 900), 100),  # the fewest any shard holds decides
    (900, (1000, 1000), 0),  # shards ahead of the ledger (rewound): nothing missing
    (1000, (0, 0), 1000),  # started over while older epochs stay counted done
    (1000, (), 0),  # no count per shard: nothing is known to be missing
])
def test_what_may_be_missing_after_a_rewind(credited, held, missing):
    assert possibly_missing(credited, held) == missing


@pytest.mark.parametrize("get_model_steps, push_steps, overlap, batch, workers, records", [
    (1, 1, False, 32, 2, 64),
    (3, 2, False, 32, 1, 128),  # rounded up to whole pushes: 4 batches
    (1, 1, True, 32, 1, 64),  # one batch's push in flight besides
    (1, 1, False, 32, 0, 32),  # no worker yet: at least one's
])
def test_records_a_refilled_shard_may_lack(get_model_steps, push_steps, overlap, batch, workers, records):
    assert records_between_pulls(get_model_steps, push_steps, overlap, batch, workers) == records


@pytest.mark.parametrize("case, expected", [
    (ResumeFacts(2, False, None), KeepLedger()),  # no checkpoints: the done records counted missing
    (ResumeFacts(2, False, GOOD_20), KeepLedger()),
    (ResumeFacts(2, True, GOOD_20), RestoreCut(None, GOOD_20, ())),  # every PS restored it at its start
    (ResumeFacts(2, True, None), StartOver(None, (0, 1), (0, 0))),  # none usable: the ledger from the start
    (ResumeFacts(2, True, DAMAGED_60), StartOver(None, (0, 1), (0, 0))),
    (ResumeFacts(2, True, ONE_COUNT_80), StartOver(None, (0, 1), (0, 0))),
])
def test_the_plan_for_a_resumed_master(case, expected):
    assert plan_resume(case) == expected
