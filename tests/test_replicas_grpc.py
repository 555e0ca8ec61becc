"""Shard replicas between two real PS processes over gRPC (docs/replicas.md): after N pushes
each backup holds its shard bit for bit as the primary does; the primary's PS SIGKILLed, the
backup is promoted, the client re-routes, and the shard goes on from where it was."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from elasticdl.config import JobConfig
from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_integrity import CHECKSUM_KEY
from elasticdl.model.optimizers import OptimizerSpec
from elasticdl.model.sharding import ps_for_variable
from elasticdl.rpc import auth, trust
from elasticdl.rpc import replica_commands as wire
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.channel import make_channel, wait_for_channel
from elasticdl.rpc.ps_client import PSClient
from elasticdl.rpc.push_outcome import PushOutcome

KEY = "replicas-test-job-key"
START_SECONDS = 60.0
TICKET = trust.mint_ticket(KEY, trust.TicketFields(task_id=1, handout=1, worker_id=0, start=0, end=1000))


def variables() -> dict[str, np.ndarray]:
    """Variables spread over both PS (by name hash)."""
    rng = np.random.default_rng(0)
    found: dict[int, list[str]] = {0: [], 1: []}
    i = 0
    while min(len(v) for v in found.values()) < 2:
        found[ps_for_variable(f"layer{i}/kernel", 2)].append(f"layer{i}/kernel")
        i += 1
    names = found[0][:2] + found[1][:2]
    return {name: rng.normal(size=(6, 3)).astype(np.float32) for name in names}


@pytest.fixture
def two_ps(tmp_path):
    """Two PS processes of a sync job with --ps_replicas 1 and --checkpoint_dir; yields
    (start(ps_id, *args), addresses, processes, checkpoint dir)."""
    ckpt = tmp_path / "ckpt"
    config = JobConfig.from_flags(model_zoo=str(tmp_path), model_def="a.b.c", training_data="x", num_ps=2,
                                  ps_replicas=1, checkpoint_dir=str(ckpt), job_name="replicas")
    (tmp_path / "job.json").write_text(config.to_json())
    (tmp_path / "opt.json").write_text(json.dumps(OptimizerSpec("Adam", {"learning_rate": 0.01}).to_json_dict()))
    key_file = auth.write_private(str(tmp_path / "key"), KEY + "\n")
    env = dict(os.environ, **{trust.JOB_KEY_FILE_ENV: key_file})
    processes: dict[int, subprocess.Popen] = {}
    logs = []

    def start(ps_id: int, *extra: str, port: int = 0) -> str:
        ready = tmp_path / f"ps-{ps_id}-{len(logs)}.port"
        log = open(tmp_path / f"ps-{ps_id}-{len(logs)}.log", "w")
        logs.append(log)
        processes[ps_id] = subprocess.Popen(
            [sys.executable, "-m", "elasticdl.ps.main", "--job_config", str(tmp_path / "job.json"),
             "--optimizer_spec", str(tmp_path / "opt.json"), "--ps_id", str(ps_id), "--port", str(port),
             "--ready_file", str(ready), *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_SECONDS
        while not ready.exists():
            assert processes[ps_id].poll() is None, (tmp_path / f"ps-{ps_id}-{len(logs) - 1}.log").read_text()
            assert time.monotonic() < deadline, "the PS did not start"
            time.sleep(0.05)  # polls the PS process for its ready file, under a deadline: no race
        return f"127.0.0.1:{ready.read_text()}"

    addresses = [start(0), start(1)]
    yield start, addresses, processes, str(ckpt)
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()
    for log in logs:
        log.close()


def master_call(address: str, method: str, args: dict) -> dict:
    channel = make_channel(address)
    wait_for_channel(channel, address, START_SECONDS)  # a relaunched PS's port: past gRPC's reconnect backoff
    try:
        return wire.command(channel, method, args, [(trust.MASTER_CREDENTIAL_HEADER, trust.master_credential(KEY))])
    finally:
        channel.close()


def replica_addresses(addresses: list[str]) -> list[str]:
    """Where each PS takes forwards: a server of its own (the master asks the same way)."""
    return [master_call(address, "routes", {})["replica_address"] for address in addresses]


def configured(addresses: list[str]) -> tuple[PSClient, dict]:
    """What the master does once every PS serves (the identity routes), then a worker's client
    and the model it pushed."""
    for address in addresses:
        master_call(address, "configure", {"addresses": replica_addresses(addresses),
                                           "routes": wire.Routes.initial(2).to_dict()})
    client = PSClient(addresses, master_credential=trust.master_credential(KEY), replicas=1)
    model = variables()
    client.push_model(model)
    return client, model


def push(client: PSClient, model: dict, rng, step: int) -> None:
    grads = {n: rng.normal(size=v.shape).astype(np.float32) for n, v in model.items()}
    versions = [s.version for s in client.stats()]
    batch = BatchPosition(task_id=1, handout=1, records_end=(step + 1) * 8, records=8, ticket=TICKET)
    answers = client.push_gradients(dict(enumerate(client.split(grads))), versions, None, 0, batch=batch)
    assert all(a.outcome is PushOutcome.APPLIED for a in answers.values()), answers


def shard_state(directory: str, version: int, shard: int) -> dict:
    """Every array of the file shard ``shard`` wrote last at ``version`` (the newest term's: a
    promoted backup writes under the promoting master's term, and a cut of files of two terms
    would not load), but its term and checksum: parameters, slots, step, data position, and each
    embedding table's rows, slots, row versions and counters."""
    files = glob.glob(f"{directory}/version-{version}/ps-{shard}-of-2*.npz")
    newest = max(files, key=lambda f: int(f.rsplit(".term-", 1)[1][:-4]) if ".term-" in f else 0)
    with np.load(newest) as data:
        return {key: data[key].tobytes() for key in data.files if key not in ("__term__", CHECKSUM_KEY)}


def test_a_backup_equals_its_primary_bit_for_bit_and_takes_over_when_it_dies(two_ps):
    start, addresses, processes, ckpt = two_ps
    routes = wire.Routes.initial(2).to_dict()
    for address in addresses:  # what the master does once every PS serves
        master_call(address, "configure", {"addresses": replica_addresses(addresses), "routes": routes})
    client = PSClient(addresses, master_credential=trust.master_credential(KEY), replicas=1)
    model = variables()
    assert client.push_model(model) == [True, True]
    rng = np.random.default_rng(1)
    for step in range(12):
        push(client, model, rng, step)
    [before] = {s.version for s in client.stats()}
    assert before == 12
    client.save_checkpoint()  # each primary writes its shard: the reference
    primary_1 = shard_state(ckpt, before, 1)

    processes[1].send_signal(signal.SIGKILL)
    processes[1].wait()
    with pytest.raises(grpc.RpcError):
        client.stats()
    promoted = master_call(addresses[0], "promote", {"shard": 1, "term": 1, "routes": {"version": 1, "primary": [0, 0]}})
    master_call(addresses[0], "set_backups", {"shard": 0, "backups": [], "term": 1})  # its backup died
    assert promoted == {"version": before}
    assert client.refresh_routes() == [1]
    client.term = 1  # the master that promoted

    client.save_checkpoint()  # now the promoted backup writes shard 1 at the same version
    assert shard_state(ckpt, before, 1) == primary_1  # every bit, slots and data position included
    assert len(glob.glob(f"{ckpt}/version-{before}/ps-1-of-2*.npz")) == 2  # the primary's file and the backup's

    # The worker's retry of the last push: the data position says it was taken already.
    retry = client.push_gradients(dict(enumerate(client.split(model))), [before, before], None, 0,
                                  batch=BatchPosition(1, 1, 12 * 8, 8, TICKET))
    assert {a.reason for a in retry.values()} == {"already applied"}
    push(client, model, rng, 12)
    assert [s.version for s in client.stats()] == [before + 1, before + 1]

    # The relaunched PS serves its old shard no more: a call sent there is told it moved.
    address = start(1, "--moved_to", json.dumps({"1": 0}), port=int(addresses[1].rsplit(":", 1)[1]))
    stale = PSClient([addresses[0], address], replicas=1)
    with pytest.raises(grpc.RpcError) as info:
        stale.stats()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE and wire.MOVED in info.value.details()
    assert stale.refresh_routes() == [1]
    assert [s.version for s in stale.stats()] == [before + 1, before + 1]


def test_the_relaunched_ps_catches_up_as_a_backup_and_takes_over_at_a_second_death(two_ps):
    start, addresses, processes, ckpt = two_ps
    client, model = configured(addresses)
    rng = np.random.default_rng(1)
    for step in range(6):
        push(client, model, rng, step)
    processes[1].send_signal(signal.SIGKILL)
    processes[1].wait()
    routes = {"version": 1, "primary": [0, 0]}
    master_call(addresses[0], "promote", {"shard": 1, "term": 1, "routes": routes})
    master_call(addresses[0], "set_backups", {"shard": 0, "backups": [], "term": 1})
    client.refresh_routes()
    client.term = 1
    for step in range(6, 9):  # trained with no backup at all
        push(client, model, rng, step)

    start(1, "--moved_to", json.dumps({"1": 0}), port=int(addresses[1].rsplit(":", 1)[1]))
    for address in addresses:  # the spare's replica server is on a new port: both learn it
        master_call(address, "configure", {"addresses": replica_addresses(addresses), "routes": routes})
    for shard in (0, 1):  # what AddBackup does: the spare is prepared, each primary sends its snapshot
        master_call(addresses[1], "prepare", {"shard": shard})
        assert master_call(addresses[0], "catch_up", {"shard": shard, "backup": 1, "term": 1})["seq"] > 0
    for step in range(9, 14):  # forwarded to the caught-up spare
        push(client, model, rng, step)
    [version] = {s.version for s in client.stats()}
    client.save_checkpoint()
    primaries = [shard_state(ckpt, version, shard) for shard in (0, 1)]

    processes[0].send_signal(signal.SIGKILL)  # the second death: PS 0 led both shards
    processes[0].wait()
    for shard in (0, 1):
        master_call(addresses[1], "promote", {"shard": shard, "term": 2, "routes": {"version": 2, "primary": [1, 1]}})
    assert client.refresh_routes() == [0, 1]
    client.term = 2
    client.save_checkpoint()
    assert [shard_state(ckpt, version, shard) for shard in (0, 1)] == primaries  # bit for bit
    push(client, model, rng, 14)
    assert [s.version for s in client.stats()] == [version + 1, version + 1]


def test_embedding_rows_a_lookup_made_are_on_the_backup_that_takes_over(two_ps):
    """Lookups create rows on the primary (some never pushed: a worker died), under a row cap
    that evicts: the promoted backup's tables, rows, slots, row versions and counters are the
    primary's, bit for bit, and training goes on from them."""
    from elasticdl.model.embedding.policy import TablePolicy
    from elasticdl.model.embedding.table import IndexedRows, TableInfo

    _start, addresses, processes, ckpt = two_ps
    client, model = configured(addresses)
    client.push_embedding_table_infos([TableInfo("ids", 3, policy=TablePolicy(max_rows=30))])
    rng = np.random.default_rng(4)

    def step(index: int) -> None:
        ids = np.unique(rng.integers(0, 200, size=16)).astype(np.int64)
        client.lookup("ids", ids, create=True)
        if index % 3 == 2:
            return  # looked up, never pushed: the rows exist on the primary all the same
        grads = {**{n: rng.normal(size=v.shape).astype(np.float32) for n, v in model.items()},
                 "ids": IndexedRows(ids, rng.normal(size=(ids.size, 3)).astype(np.float32))}
        versions = [s.version for s in client.stats()]
        batch = BatchPosition(task_id=1, handout=1, records_end=(index + 1) * 8, records=8, ticket=TICKET)
        answers = client.push_gradients(dict(enumerate(client.split(grads))), versions, None, 0, batch=batch)
        assert all(a.outcome is PushOutcome.APPLIED for a in answers.values()), answers

    for index in range(15):
        step(index)
    [before] = {s.version for s in client.stats()}
    client.save_checkpoint()
    primary_1 = shard_state(ckpt, before, 1)
    counters = checkpoint.load_shard(f"{ckpt}/version-{before}", 1, 2).embeddings["ids"].meta["counters"]
    assert counters[0] > 30 and counters[3] > 0  # rows were made, and evicted (admissions, evictions_max_rows)

    processes[1].send_signal(signal.SIGKILL)
    processes[1].wait()
    master_call(addresses[0], "promote", {"shard": 1, "term": 1, "routes": {"version": 1, "primary": [0, 0]}})
    master_call(addresses[0], "set_backups", {"shard": 0, "backups": [], "term": 1})
    client.refresh_routes()
    client.term = 1
    client.save_checkpoint()  # the promoted backup writes shard 1 at the same version
    assert shard_state(ckpt, before, 1) == primary_1
    for index in range(15, 18):
        step(index)
    assert [s.version for s in client.stats()] == [before + 2, before + 2]
