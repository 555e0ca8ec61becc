"""The nemesis's stream mode (tests/chaos/stream.py): its faults, its checks, and one short seed.

The last test runs one seed end to end (a real broker, producer, job and PS kill), the budget
``make test`` gives the stream mode; ``make chaos MODE=stream SEEDS=N`` runs many.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elasticdl.model.checkpoint import ShardState, save_shard
from tests.chaos.checks import Verdict
from tests.chaos.modes import Plan
from tests.chaos.nemesis import Settings, any_mode, replay_command, run_seed
from tests.chaos.runner import Outcome
from tests.chaos.schedule import plan_for
from tests.chaos.stream import STREAM, check_stream, stream_schedule

N = 500  # records produced, in the checks' fake runs


def test_a_stream_seed_draws_kills_on_cuts_and_master_faults_only_with_etcd():
    assert any_mode("stream") is STREAM
    actions = set()
    for seed in range(40):
        plan = plan_for(seed, 1, STREAM)
        faults = stream_schedule(plan)
        assert faults == stream_schedule(plan_for(seed, 1, STREAM)) and 1 <= len(faults) <= 3
        assert {f.trigger for f in faults} <= {"cut", "relaunch"}  # a stream has no epochs
        if plan.store == "memory":  # a restarted master without etcd starts over: never killed there
            assert not {f.action for f in faults} & {"kill_master", "cut_store"}
        actions |= {f.action for f in faults}
    assert actions == {"kill_ps", "kill_worker", "kill_master", "cut_store"}
    assert replay_command(3, Settings(mode="stream")) == "python -m tests.chaos.nemesis --seed 3 --mode stream"


def _run(tmp_path, applied=(N, N), versions=(40, 40), report=None) -> str:
    """A 2-PS stream run's directory: the final cut's shard files and the report."""
    for ps, records in enumerate(applied):
        state = ShardState(version=versions[ps], step=0, params={f"w{ps}": np.zeros(2)}, slots={},
                           records_applied=records, term=1)
        path = save_shard(str(tmp_path / "ckpt"), ps, 2, state)
        os.replace(path, tmp_path / "ckpt" / "version-40" / os.path.basename(path))
    body = {"status": "succeeded", "exit_code": 0, "model_version": 40, "checkpoint": "ckpt/version-40",
            "records_done_per_epoch": [N],
            "exactly_once": {"records_applied": list(applied), "records_done": N, "holds": list(applied) == [N, N]},
            "stream": {"records_cut": N, "lag": 0, "partitions": {
                "0": {"start": 0, "cut_to": 250, "consumed": 250, "seen": 250, "lag": 0},
                "1": {"start": 0, "cut_to": 250, "consumed": 250, "seen": 250, "lag": 0}}},
            **(report or {})}
    (tmp_path / "runs" / "chaos-7").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs" / "chaos-7" / "report.json").write_text(json.dumps(body))
    return str(tmp_path)


def _check(run_dir, produced=N, producer_done=True, code=0) -> Verdict:
    plan = Plan(seed=7, mode=STREAM, store="memory", num_ps=2, epochs=1)
    return check_stream(plan, Outcome(returncode=code, notes=["n"]), run_dir, produced, producer_done)


def test_a_stream_run_that_applied_every_record_produced_once_passes(tmp_path):
    assert _check(_run(tmp_path)) == Verdict("ok")


def test_a_resumed_stream_run_is_held_to_every_offset_of_the_topic_not_to_where_it_resumed(tmp_path):
    resumed = {"start": 120, "cut_to": 250, "consumed": 250, "seen": 250, "lag": 0}  # the last master's start
    report = {"resumed": True, "stream": {"records_cut": N, "lag": 0, "partitions": {"0": resumed, "1": resumed}}}
    assert _check(_run(tmp_path, report=report)) == Verdict("ok")  # seed 5's false alarm before


@pytest.mark.parametrize("wrong, expected", [
    ({"applied": (N + 4, N + 4)}, f"the PS applied [{N + 4}, {N + 4}] records, the producer wrote {N}"),  # twice
    ({"applied": (N, N - 3)}, "the producer wrote"),  # a record lost on one PS
    ({"versions": (40, 39)}, "shards are at versions [39, 40]"),
    ({"report": {"records_done_per_epoch": [N - 10]}}, "the ledger consumed"),
    ({"report": {"stream": {"records_cut": N, "partitions": {"0": {"start": 0, "cut_to": 240}}}}},
     "the ledger consumed"),
    ({"report": {"exactly_once": {"records_applied": [N, N], "holds": False}}}, "is not what the PS files hold"),
])
def test_a_stream_run_with_wrong_counts_is_a_violation(tmp_path, wrong, expected):
    verdict = _check(_run(tmp_path, **wrong))
    assert verdict.kind == "violation" and expected in verdict.describe(), verdict.describe()


def test_a_stream_that_ended_before_the_producer_was_done_is_a_violation(tmp_path):
    verdict = _check(_run(tmp_path), producer_done=False)
    assert verdict.kind == "violation" and "before the producer wrote them all" in verdict.describe()


# A PS SIGKILLed at the first cut of a 1-PS stream job without etcd (its ledger and model go back
# to the cut while records arrive): about 80 s on a loaded machine.
CI_SEED = 1


def test_a_short_stream_seed_ends_with_every_record_produced_applied_once(tmp_path):
    result = run_seed(CI_SEED, Settings(max_faults=1, deadline=240, mode="stream"), str(tmp_path))
    assert [f.action for f in result.faults] == ["kill_ps"] and result.plan.store == "memory"
    assert result.outcome.injected, result.outcome.skipped  # the PS was killed while the stream ran
    assert result.verdict == Verdict("ok"), (result.verdict.describe(), result.outcome.master_log_tail)
