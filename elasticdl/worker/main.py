"""Entry point of a worker process (started by a backend, not by users)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from elasticdl.config import JobConfig
from elasticdl.errors import REPORTED, report_exit
from elasticdl.launch.child import die_with_parent
from elasticdl.logs import configure_logging
from elasticdl.model.tf_runtime import configure_tensorflow, default_threads
from elasticdl.rpc.auth import TokenError, require_token
from elasticdl.worker.startup import StartupClock

logger = logging.getLogger("elasticdl.worker")


def main(argv: list[str] | None = None) -> int:
    startup = StartupClock()  # where the time to the first gradient goes: logged with it
    startup.mark("python")
    die_with_parent()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job_config", required=True, help="JobConfig JSON file")
    parser.add_argument("--worker_id", type=int, required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--ps_addrs", required=True, help="comma-separated, in PS id order")
    parser.add_argument("--command", default="train", help="the job's command: train, evaluate or predict")
    args = parser.parse_args(argv)
    try:  # every call to the master and the PS carries the job's token: without it, none would pass
        require_token(f"worker {args.worker_id}")
    except TokenError as err:
        return report_exit(f"elasticdl worker-{args.worker_id}", err)

    with open(args.job_config) as f:
        config = JobConfig.from_json(f.read())
    configure_logging(config.job.logging_level, f"worker-{args.worker_id}")
    from elasticdl.model.keras_generation import settle

    try:  # Keras 2 or 3, before TensorFlow is imported: the environment may not carry it (a pod)
        config = settle(config, announce=False)
    except REPORTED as err:
        return report_exit(f"elasticdl worker-{args.worker_id}", err)
    configure_tensorflow(  # imports TensorFlow without its banner (shown with --log_level debug)
        config.training.num_threads_per_process or default_threads(config.elasticity.num_workers)
    )
    startup.mark("tensorflow")

    # Imported after the thread limits: these pull in TensorFlow.
    from elasticdl.model.spec import load_model_spec
    from elasticdl.model.trainer import Trainer
    from elasticdl.rpc.master_client import MasterClient
    from elasticdl.rpc.ps_client import PSClient
    from elasticdl.worker.consistency import ConsistencyPolicy
    from elasticdl.worker.worker import Worker

    startup.mark("elasticdl")
    spec = load_model_spec(config.training.model_zoo, config.training.model_def,
                           config.model_zoo_functions.names())
    startup.mark("model zoo")
    ps = PSClient(args.ps_addrs.split(","), wire_dtype=config.training.wire_dtype,
                  tensor_transport=config.training.tensor_transport)
    trainer = Trainer(spec, config.training.model_params, config.training.embedding_swap_threshold_mb)
    startup.mark("model")
    worker = Worker(
        worker_id=args.worker_id,
        spec=spec,
        trainer=trainer,
        master=MasterClient(args.master_addr, args.worker_id),
        ps=ps,
        minibatch_size=config.training.minibatch_size,
        has_header=config.data.has_header,
        columns=config.data.columns,
        records=config.data.records,
        consistency=ConsistencyPolicy.from_config(config, ps.num_ps),
        prediction_outputs=config.outputs.prediction_outputs,
        may_initialize_ps=args.command == "train",
        max_bad_records=config.data.max_bad_records if args.command != "predict" else 0,
        startup=startup,
    )
    # Preemption is a scale-down, not a failure: finish the batch, report, leave (exit 0).
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
