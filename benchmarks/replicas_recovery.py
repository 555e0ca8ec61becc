"""The ``elastic_recovery`` case's replicas row: from the SIGKILL of a primary's PS to training
again with ``--ps_replicas 1`` (a child process's part of benchmarks/elastic_recovery.py).

The job of ``ps_rep`` (1 worker, 2 PS, sync, ``--checkpoint_steps 40``) with ``--ps_replicas
1``; PS 1 is SIGKILLed once the first cut is complete, as there. Shard 1 then goes on from its
backup on PS 0: a client polling every 10 ms follows the routes as the PS tell them (as a worker
does), and training is on again when shard 1, answered by its new primary, makes a version
after the first it answered with (one step of the worker at most is counted in). Nothing is
rolled back: the figure is the detection of the exit, the promotion, the worker's re-route and
its push in flight retried.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from benchmarks.elastic_recovery import _lines, _start_job, _stop_job, at_first_cut, cut_flags


def replica_ps_rep(spec: dict, rep: int, workdir: str) -> dict:
    from elasticdl.rpc.ps_client import PSClient

    job = f"replica-recovery-r{rep}"
    proc = _start_job(spec, job, workdir, "--num_ps", "2", "--ps_replicas", "1", *cut_flags(workdir, job))
    try:
        master, addresses, token, victim = at_first_cut(spec, job, workdir, proc)
        client = PSClient(list(addresses), token=token, replicas=1)
        try:
            before = client.stats()[1].version
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            first = None  # shard 1's version as its new primary first answered
            while time.time() - killed < spec["timeout"]:
                try:
                    version = client.stats()[1].version
                except grpc.RpcError:  # down, or "moved": where is shard 1 now?
                    client.refresh_routes()
                    time.sleep(0.01)
                    continue
                if client.routes.primary[1] == 0:
                    if first is None:
                        first = (version, time.time())
                    elif version > first[0]:
                        resumed = time.time()
                        break
                time.sleep(0.01)
            else:
                raise TimeoutError("training did not go on after the PS was killed (--ps_replicas 1)")
        finally:
            client.close()
        if first[0] < before:
            raise RuntimeError(f"shard 1 went back from version {before} to {first[0]}: a rollback, not a failover")
        rolled_back = [line for line in _lines(master) if "went back to the checkpoint" in line]
    finally:
        _stop_job(proc)
    return {"kill_ps_replicas_s": resumed - killed, "promoted_s": first[1] - killed,
            "replicas_rolled_back": len(rolled_back)}
