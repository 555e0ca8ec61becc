"""Entry point of a parameter-server process (started by a backend, not by users)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import threading
import time

from elasticdl.config import JobConfig
from elasticdl.errors import report_exit
from elasticdl.launch.child import die_with_parent, exit_now
from elasticdl.logs import configure_logging
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.server import SERVER_THREADS, ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc.auth import TokenError, require_token
from elasticdl.rpc.channel import POD_IP_ENV, add_service, bind_role, make_server
from elasticdl.rpc.trust import TicketVerifier, require_job_key

logger = logging.getLogger("elasticdl.ps")


def settings_from_config(config: JobConfig, ps_id: int) -> PSSettings:
    return PSSettings(
        ps_id=ps_id,
        num_ps=config.elasticity.num_ps,
        grads_to_wait=config.consistency.grads_to_wait,
        use_async=config.consistency.use_async,
        checkpoint_dir=config.checkpoints.checkpoint_dir,
        checkpoint_steps=config.checkpoints.checkpoint_steps,
        keep_checkpoint_max=config.checkpoints.keep_checkpoint_max,
        checkpoint_dir_for_init=config.checkpoints.checkpoint_dir_for_init,
        sync_version_tolerance=config.consistency.sync_version_tolerance,
        lr_staleness_modulation=config.consistency.lr_staleness_modulation,
        minibatch_size=config.training.minibatch_size,
        max_gradient_norm_ratio=config.consistency.max_gradient_norm_ratio,
        slice_dense_above_mb=config.training.slice_dense_above_mb,
    )


def main(argv: list[str] | None = None, assigned_at: float | None = None) -> int:
    """``assigned_at``: a warm spare's ``time.monotonic()`` when it got ``argv``
    (elasticdl/launch/warm.py); its start-up is logged from there."""
    die_with_parent()
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--job_config", required=True, help="JobConfig JSON file")
    parser.add_argument("--optimizer_spec", required=True, help="OptimizerSpec JSON file")
    parser.add_argument("--ps_id", type=int, required=True)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--ready_file", default="", help="write the bound port here once serving")
    parser.add_argument(
        "--restore_from", default="",
        help="a relaunched PS or a resumed job: restore its shard, with its data position, from this checkpoint"
    )
    parser.add_argument("--term", type=int, default=0, help="the master's leadership term (a fencing token)")
    parser.add_argument("--fence", type=int, default=0,
                        help="refuse pushes of task hand-outs below this (a relaunch after a rollback)")
    parser.add_argument("--moved_to", default="{}",
                        help='--ps_replicas: JSON {"shard": ps} of shards whose primary moved (a relaunch after a promotion)')
    args = parser.parse_args(argv)
    try:  # first: a PS without the job's token would serve anyone who reaches its port
        token = require_token(f"parameter server {args.ps_id}")
        verifier = TicketVerifier(require_job_key(f"parameter server {args.ps_id}"))  # checks pushes' tickets
    except TokenError as err:
        return report_exit(f"elasticdl ps-{args.ps_id}", err)

    with open(args.job_config) as f:
        config = JobConfig.from_json(f.read())
    with open(args.optimizer_spec) as f:
        spec = OptimizerSpec.from_json_dict(json.load(f))
    configure_logging(config.job.logging_level, f"ps-{args.ps_id}")

    settings = dataclasses.replace(settings_from_config(config, args.ps_id), term=args.term, fence_floor=args.fence)
    if args.restore_from:
        settings = dataclasses.replace(settings, checkpoint_dir_for_init=args.restore_from, restore_position=True)
    core = ParameterServer(settings, make_optimizer(spec), verifier=verifier)
    core.restore()
    server = make_server(max_workers=SERVER_THREADS, token=token)  # see MAX_WAITING_PULLS
    replica_server = None
    if config.elasticity.ps_replicas:  # docs/replicas.md
        from elasticdl.ps.replica_host import serve_replicas
        from elasticdl.rpc.trust import master_credential

        servicer, replica_server = serve_replicas(
            server, core, config.elasticity.ps_replicas, lambda: make_optimizer(spec), token,
            master_credential(require_job_key(f"parameter server {args.ps_id}")),
            {int(k): int(v) for k, v in json.loads(args.moved_to).items()})
    else:
        servicer = PServerServicer(core)
        add_service(server, "PServer", servicer)
    port = bind_role(server, args.port)
    server.start()
    bulk_server = None
    if config.training.tensor_transport == "tcp":
        from elasticdl.ps.bulk_server import BulkServer

        bulk_server = BulkServer(servicer, token, os.environ.get(POD_IP_ENV, "") or "127.0.0.1")
        logger.info("tensor bytes also on raw TCP port %d (--tensor_transport tcp)", bulk_server.start())
    logger.info("serving on 127.0.0.1:%d (%s, %s)%s", port, spec.name, config.consistency.description,
                "" if assigned_at is None else f", a warm spare {time.monotonic() - assigned_at:.2f}s after its command line")
    registration = None
    stop = threading.Event()
    lost: list[str] = []

    def lease_lost(why: str) -> None:
        # The seed design's rule: a PS whose lease expires ends itself. Its master sees it gone
        # (or is gone itself) and relaunches it from the latest cut; serving on could only mix
        # its updates into a model the job has moved past.
        lost.append(why)
        logger.error("this PS's lease in etcd could not be renewed (%s): it ends itself", why)
        stop.set()

    if config.elasticity.etcd_endpoints:
        # Registered with a lease: the address disappears from etcd when this PS does.
        from elasticdl.store import EtcdStateStore, StateStoreError

        try:
            registration = EtcdStateStore(config.elasticity.etcd_endpoints, config.job.job_name).publish_address(
                "ps", args.ps_id, f"127.0.0.1:{port}", on_lost=lease_lost,
            )
        except StateStoreError as err:
            logger.warning("could not register this PS in etcd (training goes on): %s", err)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.ready_file)

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    if replica_server is not None:
        replica_server.stop(grace=0)
    if bulk_server is not None:
        bulk_server.stop()
    if registration is not None and not lost:
        registration.revoke()
    logger.info("stopped at version %d", core.shard.version)
    return 1 if lost else 0


if __name__ == "__main__":
    exit_now(main())  # see exit_now: a role leaves at once
