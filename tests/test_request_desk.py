"""The job loop serves the workers' requests (elasticdl/master/request_desk.py, requests.py):
in arrival order, on one thread, parking a request for a task until a ledger changes, its
deadline, or the job's end. An injected clock; no threads, no sleeps."""

from __future__ import annotations

import queue
import types

import pytest

from elasticdl.data.sources import Shard
from elasticdl.master.controller import ScaleRequested, TaskReported, VersionReported
from elasticdl.master.evaluation_service import EvaluationService, FrozenSnapshot, TaskDispatcher
from elasticdl.master.job import Job
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.request_desk import RequestDesk
from elasticdl.master.requests import (
    END,
    WAIT,
    GetTask,
    LoopBusy,
    ReportProgress,
    ReportTask,
    RequestLine,
    Verdict,
)
from elasticdl.master.task_manager import TaskManager


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def desk_for(shards: int = 1, epochs: int = 2, evaluation: EvaluationService | None = None):
    clock = FakeClock()
    tasks = TaskManager([Shard("f", i * 10, i * 10 + 10) for i in range(shards)], num_epochs=epochs,
                        shuffle=False, gate_epochs=True, clock=clock)
    dispatcher = TaskDispatcher(tasks, evaluation)
    progress = TrainingProgress(10 * shards, epochs)
    return RequestDesk(dispatcher, progress, clock=clock), dispatcher, tasks, clock, progress


def served(desk: RequestDesk, request):
    events = desk.serve(request)
    return events, request.future


def test_a_parked_request_gets_the_next_epochs_task_when_the_epoch_opens():
    """A worker's request held between epochs is answered with a task as soon as the epoch opens
    (a worker told to wait and retry later idled half a second at every epoch's end)."""
    desk, dispatcher, tasks, _, _ = desk_for()
    _, first = served(desk, GetTask(0))
    task = first.result(0)
    assert task.kind == "training" and task.epoch == 0
    served(desk, ReportTask(task.task_id, 0, records=10, handout=task.handout))
    _, held = served(desk, GetTask(0, wait=60.0))
    assert not held.done() and desk.parked == 1  # epoch 1 is gated: the request waits
    desk.settle()
    assert not held.done()  # nothing changed
    tasks.open_epoch(1)  # the controller's OpenEpoch, on the loop's thread
    desk.settle()
    assert held.result(0).kind == "training" and held.result(0).epoch == 1
    assert desk.parked == 0


def test_a_parked_request_answers_wait_at_its_deadline():
    desk, _, _, clock, _ = desk_for()
    served(desk, GetTask(0))  # worker 0 holds the only task
    _, held = served(desk, GetTask(1, wait=1.0))
    assert desk.next_deadline() == clock.now + 1.0
    clock.now += 0.5
    desk.settle()
    assert not held.done()
    clock.now += 0.5
    desk.settle()
    assert held.result(0) == WAIT and desk.next_deadline() is None


def test_a_request_that_may_not_wait_answers_wait_at_once():
    desk, _, _, _, _ = desk_for()
    served(desk, GetTask(0))
    _, answer = served(desk, GetTask(1))
    assert answer.result(0) == WAIT and desk.parked == 0


def test_parked_requests_get_end_at_once_when_the_job_finishes():
    desk, dispatcher, _, _, _ = desk_for()
    served(desk, GetTask(0))
    _, held = served(desk, GetTask(1, wait=60.0))
    dispatcher.finish()  # the controller: all done
    desk.settle()
    assert held.result(0) == END
    _, later = served(desk, GetTask(2, wait=60.0))
    assert later.result(0) == END and desk.parked == 0


def test_a_halted_master_answers_wait_at_once_and_refuses_reports():
    desk, dispatcher, tasks, _, _ = desk_for()
    _, first = served(desk, GetTask(0))
    _, held = served(desk, GetTask(1, wait=60.0))
    dispatcher.halt("lost the leader lock")  # a store thread: only a flag
    dispatcher.finish()  # even then: another master may own the ledger, so no END
    desk.settle()
    assert held.result(0) == WAIT
    _, again = served(desk, GetTask(1, wait=60.0))
    assert again.result(0) == WAIT and desk.parked == 0  # not parked: nothing will come
    events, report = served(desk, ReportTask(first.result(0).task_id, 0, records=10))
    assert report.result(0) == Verdict(False, "this master stopped acting: lost the leader lock")
    assert events == [TaskReported(first.result(0).task_id, 0, False)]
    assert tasks.epochs[0].records_done == 0


def test_reports_give_the_controller_its_events_and_the_progress_line_its_records():
    desk, _, tasks, _, progress = desk_for()
    _, first = served(desk, GetTask(3))
    task = first.result(0)
    events, answer = served(desk, ReportProgress(task.task_id, 3, 4, model_version=17))
    assert answer.result(0).accepted and events == [VersionReported(17)]
    events, answer = served(desk, ReportProgress(task.task_id, 9, 4, model_version=18))  # not its task
    assert not answer.result(0).accepted and events == []  # a refused report's version is not taken
    events, answer = served(desk, ReportTask(task.task_id, 3, records=10, loss_sum=2.0, batches=2,
                                             model_version=17, handout=task.handout))
    assert answer.result(0) == Verdict(True, "") and events == [TaskReported(task.task_id, 3, True)]
    assert tasks.epochs[0].records_done == 10 and progress.records_trained == 10


def test_a_report_the_servicer_found_wrong_is_refused_and_still_told_to_the_controller():
    desk, _, tasks, _, progress = desk_for()
    task = served(desk, GetTask(3))[1].result(0)
    events, answer = served(desk, ReportTask(task.task_id, 3, records=10, problem="a loss sum of nan"))
    assert answer.result(0) == Verdict(False, "a loss sum of nan")
    assert events == [TaskReported(task.task_id, 3, False)]
    assert tasks.epochs[0].records_done == 0 and progress.records_trained == 0


def test_a_withdrawn_request_is_never_served():
    """Its gRPC thread gave up (the loop was busy) and the worker will ask again: serving it
    later would hand out a task nobody takes."""
    desk, _, tasks, _, _ = desk_for()
    request = GetTask(0)
    assert request.future.cancel()
    assert desk.serve(request) == []
    assert served(desk, GetTask(1))[1].result(0).task_id == 0  # the only task is still there
    assert tasks.active_workers() == {1}


def test_the_line_withdraws_a_request_the_loop_did_not_take_in_time():
    requests: queue.SimpleQueue = queue.SimpleQueue()
    line = RequestLine(requests.put)
    with pytest.raises(LoopBusy, match="did not take the request within 0s"):
        line.ask(GetTask(0), timeout=0.0)
    assert requests.get_nowait().future.cancelled()


def test_the_line_returns_an_answer_that_is_there_even_with_no_time_left_to_wait():
    desk, _, _, _, _ = desk_for()
    line = RequestLine(desk.serve)  # the loop serves at once: the answer is there before the wait
    assert line.ask(GetTask(0), timeout=0.0).kind == "training"


def test_an_evaluation_round_that_starts_hands_a_parked_request_its_task():
    clock = FakeClock()
    evaluation = EvaluationService([Shard("v", 0, 4)], lambda: {}, clock=clock)
    desk, _, _, _, _ = desk_for(evaluation=evaluation)
    served(desk, GetTask(0))
    _, held = served(desk, GetTask(1, wait=60.0))
    desk.settle()
    assert not held.done()
    evaluation.start("epoch 1", FrozenSnapshot(evaluation.reserve_round(), 5))
    desk.settle()
    assert held.result(0).kind == "evaluation" and held.result(0).snapshot_id == 1


def test_the_loop_publishes_the_workers_holding_a_task_for_report_clock():
    desk, _, _, _, _ = desk_for(shards=2)
    assert desk.active_workers == frozenset()
    served(desk, GetTask(4))
    assert desk.active_workers == frozenset({4})


def loop_of(desk: RequestDesk) -> types.SimpleNamespace:
    """What Job._next_events uses of a Job."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    return types.SimpleNamespace(desk=desk, _events=events, poll_seconds=0.0,
                                 requests=RequestLine(events.put))


def test_the_job_loop_serves_requests_in_arrival_order_among_its_events():
    desk, _, _, _, _ = desk_for(shards=2)
    job = loop_of(desk)
    first, second = GetTask(7), GetTask(8)
    job._events.put(first)
    job._events.put(ScaleRequested(3))
    job._events.put(second)
    job._events.put(ReportProgress(0, 7, 2, model_version=5))
    job._events.put(ReportProgress(1, 8, 2, model_version=9))
    assert Job._next_events(job) == [ScaleRequested(3), VersionReported(9)]  # one version: the newest
    assert (first.future.result(0).task_id, second.future.result(0).task_id) == (0, 1)


def test_requests_left_when_the_loop_stops_get_their_answer_from_no_ledger():
    desk, dispatcher, tasks, _, _ = desk_for(shards=2)
    job = loop_of(desk)
    parked_first = GetTask(0)
    served(desk, GetTask(1))
    served(desk, GetTask(2))  # every task is held
    served(desk, parked := GetTask(3, wait=60.0))
    queued_task, queued_report = GetTask(4), ReportTask(0, 1, records=10)
    job._events.put(queued_task)
    job._events.put(queued_report)
    dispatcher.finish()
    desk.close(job.requests, job._events)
    assert parked.future.result(0) == END and queued_task.future.result(0) == END
    assert queued_report.future.result(0) == Verdict(False, "the master's job loop has stopped")
    assert job.requests.ask(parked_first, timeout=0.0) == END  # asked later: answered at once
    assert tasks.epochs[0].records_done == 0 and job._events.empty()


def test_a_request_parked_by_a_worker_that_died_gets_end_and_its_task_goes_to_a_live_one():
    """The CI hang of test_e2e_kafka's worker kill: worker 0's request for a task was parked when
    it was SIGKILLed; the master handled its exit (nothing of its was in progress), then the next
    change of the ledger handed the parked request a task. That task sat in doing for a worker
    that no longer existed, and the job never ended. A dead worker's request gets END, and the
    task goes to the live worker who asks."""
    desk, dispatcher, tasks, _, _ = desk_for(shards=1, epochs=1)
    held = served(desk, GetTask(1))[1].result(0)
    _, parked = served(desk, GetTask(0, wait=60.0))  # worker 0 waits: worker 1 holds the only task
    assert not parked.done() and desk.parked == 1
    dispatcher.recover_worker_tasks(0)  # the controller handles worker 0's exit
    served(desk, ReportTask(held.task_id, 1, records=4, handout=held.handout, interrupted=True))
    desk.settle()  # the rest of the task is back in todo: not for the dead worker
    assert parked.result(0) == END and desk.parked == 0
    assert served(desk, GetTask(0))[1].result(0) == END  # a request of its queued behind its exit
    rest = served(desk, GetTask(2))[1].result(0)
    assert (rest.kind, rest.start, rest.end) == ("training", 4, 10)
