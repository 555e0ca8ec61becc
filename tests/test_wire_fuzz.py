"""Fuzzed request fields over real gRPC against a real PS and a real master servicer: the
servers stay up, answer only OK, INVALID_ARGUMENT, FAILED_PRECONDITION or NOT_FOUND, and a
refused request leaves their state (PS version, parameters, snapshots, learning rate; the
master's ledger) as it was."""

from __future__ import annotations

import copy
import math
import queue

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from master_loop import master_servicer

from elasticdl.data.sources import Shard
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_service import EvaluationService, FrozenSnapshot, TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.task_manager import TaskManager
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.NOT_FOUND}
MODEL = {"dense/kernel": (3, 2), "dense/bias": (2,), "bn/moving_mean": (2,)}
NON_TRAINABLE = {"bn/moving_mean"}  # changed by pushed non_trainable_changes, never by gradients
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- field strategies

numbers = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e9, -1e9, 3e38, 1e-30, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)
small_waits = st.floats(min_value=0.0, max_value=0.05)  # valid waits, kept short
ints64 = st.one_of(st.sampled_from([0, -1, -2, 1, 2**62, -(2**63), 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))
ints32 = st.one_of(st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
names = st.one_of(st.sampled_from([*MODEL, "", "dense", "emb", "/", "dense/kernel/0", "\x00", "é" * 40]),
                  st.text(max_size=20))
dtypes = st.sampled_from(["float32", "float64", "float16", "int32", "int64", "bool", "", "object", "<f4", "complex64",
                          "str"])
shapes = st.one_of(
    st.sampled_from([(3, 2), (2,), (), (0,), (2**40, 2**40), (0, 2**62, 2**62), (-1,), (1, 1, 1, 1)]),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
)


@st.composite
def tensors(draw, name=names):
    """A Tensor message whose bytes usually, but not always, fit its dtype and shape; values
    included NaN, Inf and huge numbers."""
    dtype, shape = draw(dtypes), draw(shapes)
    size = math.prod(shape) if all(d >= 0 for d in shape) else 0
    try:
        itemsize = np.dtype(dtype).itemsize if dtype and dtype not in ("object", "str") else 4
    except TypeError:
        itemsize = 4
    if size <= 64 and draw(st.booleans()):
        count = size
    else:
        count = draw(st.integers(0, 16))
    if dtype in ("float32", "float64", "float16"):
        values = draw(st.lists(numbers, min_size=count, max_size=count))
        with np.errstate(over="ignore"):
            content = np.array(values, np.float64).astype(dtype).tobytes()
    else:
        content = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    if draw(st.integers(0, 9)) == 0:
        content = content[:-1] + b"\0\0"  # a byte count that does not fit
    return elasticdl_pb2.Tensor(name=draw(name), dtype=dtype, shape=[max(-(2**63), min(d, 2**63 - 1)) for d in shape],
                                content=content, offset=draw(st.sampled_from([0, 0, 0, 1, -1])))


model_names = st.sampled_from(list(MODEL))
# A push on the PS's current version (filled in at call time: the version moves as pushes apply).
CURRENT = -999


@st.composite
def fitting_gradients(draw, non_trainable: bool = False):
    """Gradients of the model's trainable variables (``non_trainable``: changes of the others)
    with their shapes (some left out), mostly finite."""
    out = []
    for name, shape in MODEL.items():
        if (name in NON_TRAINABLE) != non_trainable or draw(st.integers(0, 4)) == 0:
            continue
        values = draw(st.lists(st.one_of(st.floats(-10, 10, width=32), numbers) if draw(st.integers(0, 5)) == 0
                               else st.floats(-10, 10, width=32), min_size=math.prod(shape), max_size=math.prod(shape)))
        with np.errstate(over="ignore"):
            array = np.array(values, np.float64).astype(np.float32).reshape(shape)
        out.append(elasticdl_pb2.Tensor(name=name, dtype="float32", shape=shape, content=array.tobytes()))
    return out


def ps_requests():
    pull = st.builds(
        elasticdl_pb2.PullDenseParametersRequest,
        version=ints64, wait_for_newer=st.booleans(), timeout_seconds=st.one_of(numbers, small_waits),
        snapshot_id=st.one_of(ints64, st.integers(0, 5)),
    )
    push = st.builds(
        elasticdl_pb2.PushGradientsRequest,
        worker_id=ints32, version=st.one_of(ints64, st.integers(-2, 3)), learning_rate=st.one_of(numbers, st.just(0.0)),
        gradients=st.lists(tensors(st.one_of(model_names, names)), max_size=3),
        embedding_gradients=st.lists(st.builds(elasticdl_pb2.IndexedRows, name=names, ids=tensors(), values=tensors()),
                                     max_size=1),
        return_parameters=st.booleans(),
        non_trainable_changes=st.lists(tensors(st.one_of(model_names, names)), max_size=2),
    )
    model = st.builds(
        elasticdl_pb2.Model, version=ints64, dense_parameters=st.lists(tensors(st.one_of(model_names, names)), max_size=3),
        variables=st.lists(st.one_of(model_names, names), max_size=3),
        non_trainable=st.lists(st.one_of(model_names, names), max_size=2),
    )
    snapshot = st.builds(elasticdl_pb2.Snapshot, snapshot_id=st.one_of(ints64, st.integers(-1, 6)), version=ints64)
    infos = st.builds(elasticdl_pb2.EmbeddingTableInfos, tables=st.lists(st.builds(
        elasticdl_pb2.EmbeddingTableInfo, name=names, dim=st.one_of(ints64, st.integers(-1, 8)),
        initializer=st.one_of(st.sampled_from(['', '{}', '{"distribution": "uniform", "minval": 0, "maxval": 1, '
                                               '"seed": 1}', '[' * 5000, 'null', '{"distribution": "constant"}']),
                              st.text(max_size=30))), max_size=2))
    fitting_push = st.builds(
        elasticdl_pb2.PushGradientsRequest,
        worker_id=st.integers(0, 3), version=st.one_of(st.just(CURRENT), st.just(CURRENT), ints64),
        learning_rate=st.one_of(st.just(0.0), st.floats(1e-3, 1.0), numbers), gradients=fitting_gradients(),
        return_parameters=st.booleans(), non_trainable_changes=fitting_gradients(non_trainable=True),
    )
    return st.one_of(
        st.tuples(st.just("push_gradients"), fitting_push),
        st.tuples(st.just("push_gradients"), fitting_push),
        st.tuples(st.just("push_gradients_stream"), st.lists(fitting_push, min_size=1, max_size=1)),
        st.tuples(st.just("pull_dense_parameters"), pull),
        st.tuples(st.just("pull_dense_parameters_stream"), pull),
        st.tuples(st.just("push_gradients"), push),
        st.tuples(st.just("push_gradients_stream"), st.lists(push, min_size=0, max_size=2)),
        st.tuples(st.just("push_model"), model),
        st.tuples(st.just("take_snapshot"), snapshot),
        st.tuples(st.just("drop_snapshot"), snapshot),
        st.tuples(st.just("set_learning_rate"), st.builds(elasticdl_pb2.LearningRate, value=numbers)),
        st.tuples(st.just("set_live_workers"), st.builds(elasticdl_pb2.LiveWorkers, count=ints32)),
        st.tuples(st.just("level_version"), st.builds(elasticdl_pb2.LevelRequest, version=ints64, term=ints64)),
        st.tuples(st.just("push_embedding_table_infos"), infos),
        st.tuples(st.just("pull_embedding_vectors"), st.builds(
            elasticdl_pb2.PullEmbeddingVectorsRequest, name=st.one_of(st.just("emb"), names), ids=tensors(),
            create=st.booleans(), snapshot_id=st.one_of(ints64, st.integers(-1, 3)))),
        st.tuples(st.just("pull_embedding_table"), st.builds(
            elasticdl_pb2.PullEmbeddingTableRequest, name=st.one_of(st.just("emb"), names),
            rows_per_chunk=st.one_of(ints64, st.integers(-1, 3)))),
        st.tuples(st.just("get_stats"), st.just(elasticdl_pb2.Empty())),
    )


# ---------------------------------------------------------------- servers


def _call(stub, method: str, request):
    """(status code, reply); a streamed call's replies are read to the end."""
    try:
        reply = getattr(stub, method)(iter(request) if isinstance(request, list) else request, timeout=20)
        if hasattr(reply, "__next__"):
            reply = list(reply)
        return grpc.StatusCode.OK, reply
    except grpc.RpcError as err:
        return err.code(), err.details()


@pytest.fixture(scope="module")
def real_ps():
    core = ParameterServer(PSSettings(grads_to_wait=2), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})))
    rng = np.random.default_rng(0)
    core.push_model({name: rng.normal(size=shape).astype(np.float32) for name, shape in MODEL.items()},
                    non_trainable=NON_TRAINABLE)
    server = grpc_utils.make_server(max_workers=4)
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    channel = grpc_utils.make_channel(f"127.0.0.1:{port}")
    yield core, elasticdl_pb2_grpc.PServerStub(channel)
    channel.close()
    server.stop(grace=None)


def ps_state(core: ParameterServer):
    shard = core.shard
    return (shard.initialized, shard.version, shard.step, {n: v.tobytes() for n, v in shard.params.items()},
            sorted(core._snapshots), core._learning_rate, core.strategy.grads_to_wait, sorted(shard.non_trainable),
            {n: t.state()[0].tobytes() for n, t in shard.embeddings.items()})


def _label(method: str, code, reply, refused: bool) -> str:
    """For --hypothesis-show-statistics: what was asked, and how it was answered."""
    why = reply if isinstance(reply, str) else getattr(reply, "reason", "")
    return f"{method}: {code.name}{' refused' if refused else ''} {why[:40]}"


def _refused(method: str, code, reply) -> bool:
    if code != grpc.StatusCode.OK:
        return True
    if method.startswith("push_gradients"):
        return reply.outcome in (elasticdl_pb2.REJECTED_INVALID, elasticdl_pb2.REJECTED_STALE)
    if method == "push_model":
        return not reply.accepted
    return False


@FUZZ
@given(call=ps_requests())
def test_fuzzed_ps_requests_are_answered_and_refusals_change_nothing(real_ps, call):
    core, stub = real_ps
    method, request = call
    for message in request if isinstance(request, list) else [request]:
        if getattr(message, "version", None) == CURRENT:
            message.version = core.shard.version
    before = ps_state(core)
    code, reply = _call(stub, method, request)
    assert code in ALLOWED, (method, code, reply)
    event(_label(method, code, reply, _refused(method, code, reply)))
    if _refused(method, code, reply):
        assert ps_state(core) == before, (method, code, reply)
    # Still serving, and still holding the model it was given.
    code, stats = _call(stub, "get_stats", elasticdl_pb2.Empty())
    assert code == grpc.StatusCode.OK and stats.version == core.shard.version
    assert sorted(core.shard.params) == sorted(MODEL) and core.shard.non_trainable == NON_TRAINABLE


# ---------------------------------------------------------------- the master


@pytest.fixture(scope="module")
def real_master():
    main = TaskManager([Shard("train", i * 10, i * 10 + 10) for i in range(4)], num_epochs=10**6, shuffle=False)
    evaluation = EvaluationService([Shard("valid", 0, 8)], lambda: {"m": lambda y, p: np.zeros(1)})
    evaluation.start("fuzz", FrozenSnapshot(evaluation.reserve_round(), 3))
    dispatcher = TaskDispatcher(main, evaluation)
    events: queue.SimpleQueue = queue.SimpleQueue()
    server = grpc_utils.make_server(max_workers=4)
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        master_servicer(dispatcher, TrainingProgress(40, 10**6), WorkerClocks(), notify=events.put), server
    )
    port = grpc_utils.bind_local(server, 0)
    server.start()
    channel = grpc_utils.make_channel(f"127.0.0.1:{port}")
    stub = elasticdl_pb2_grpc.MasterStub(channel)
    held = [stub.get_task(elasticdl_pb2.GetTaskRequest(worker_id=w), timeout=10) for w in (0, 1)]
    yield dispatcher, stub, held
    channel.close()
    server.stop(grace=None)


def master_state(dispatcher: TaskDispatcher):
    main, round_ = dispatcher.main, dispatcher.evaluation.current
    return (main.snapshot().tasks, [copy.copy(e) for e in main.epochs],
            None if round_ is None else (round_.tasks.snapshot().tasks, round_.merger.tasks, round_.records))


@st.composite
def master_requests(draw, held):
    # A task held now (chosen by position: what is held depends on earlier examples), or any id.
    slot = draw(st.integers(0, 3))
    worker_id = draw(st.one_of(st.sampled_from([0, 1, 2, 3]), ints32))
    task_id = draw(st.one_of(st.none(), ints64))
    task_id = held[slot % len(held)].task_id if task_id is None else task_id
    kind = draw(st.sampled_from(["report", "report", "progress", "get_task", "clock"]))
    if kind == "report":
        return "report_task_result", elasticdl_pb2.ReportTaskResultRequest(
            worker_id=worker_id, task_id=task_id, err_message=draw(st.sampled_from(["", "", "boom", "\x00" * 3])),
            records=draw(st.one_of(ints64, st.integers(-1, 11), st.integers(0, 10))),
            loss_sum=draw(st.one_of(numbers, st.just(0.5), st.just(0.5))),
            batches=draw(st.one_of(ints64, st.integers(0, 3), st.integers(0, 3))),
            model_version=draw(st.one_of(ints64, st.integers(-2, 5), st.integers(0, 5))),
            metric_states=draw(st.one_of(
                st.just([]), st.lists(tensors(st.one_of(st.just("m/0"), names)), max_size=2),
                st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=2).map(
                    lambda v: [elasticdl_pb2.Tensor(name="m/0", dtype="float64", shape=[2],
                                                    content=np.array(v, np.float64).tobytes())]),
            )),
            interrupted=draw(st.booleans()),
        )
    if kind == "progress":
        return "report_progress", elasticdl_pb2.ReportProgressRequest(
            worker_id=worker_id, task_id=task_id, records_done=draw(st.one_of(ints64, st.integers(-1, 11))),
            model_version=draw(ints64))
    if kind == "get_task":
        return "get_task", elasticdl_pb2.GetTaskRequest(worker_id=draw(st.one_of(ints32, st.integers(-1, 3))))
    return "report_clock", elasticdl_pb2.ReportClockRequest(
        worker_id=worker_id, clock=draw(ints64), blocked_seconds=draw(st.one_of(numbers, small_waits)))


@FUZZ
@given(data=st.data())
def test_fuzzed_master_requests_are_answered_and_refusals_change_nothing(real_master, data):
    dispatcher, stub, held = real_master
    method, request = data.draw(master_requests(held))
    before = master_state(dispatcher)
    code, reply = _call(stub, method, request)
    assert code in ALLOWED, (method, code, reply)
    refused = code != grpc.StatusCode.OK or (method == "report_task_result" and not reply.accepted)
    event(_label(method, code, reply, refused))
    if refused:
        assert master_state(dispatcher) == before, (method, code, reply)
    if method == "get_task" and code == grpc.StatusCode.OK and reply.type in (elasticdl_pb2.TRAINING,
                                                                              elasticdl_pb2.EVALUATION):
        held[:] = [*held[-3:], reply]  # later examples report it, under its worker's id or another
    for epoch in dispatcher.main.epochs:  # never more records done than an epoch holds
        assert 0 <= epoch.records_done <= epoch.records_total
    # Still serving (a progress report of no task is refused, and changes nothing).
    no_task = elasticdl_pb2.ReportProgressRequest(worker_id=0, task_id=-5)
    assert _call(stub, "report_progress", no_task)[0] == grpc.StatusCode.FAILED_PRECONDITION
