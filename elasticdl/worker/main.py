"""Entry point of a worker process (started by a backend, not by users)."""

from __future__ import annotations

import argparse
import logging
import signal

from elasticdl.config import JobConfig
from elasticdl.errors import REPORTED, report_exit
from elasticdl.launch.child import die_with_parent, exit_now
from elasticdl.logs import configure_logging
from elasticdl.model.tf_runtime import configure_tensorflow, default_threads
from elasticdl.rpc.auth import TokenError, require_token
from elasticdl.worker.startup import StartupClock

logger = logging.getLogger("elasticdl.worker")


_WARM: dict = {}  # what warm_up did: {"config": the JobConfig JSON it rehearsed with, "threads": n}


def warm_up(argv: list[str], assigned=lambda: False) -> None:
    """What a warm spare (elasticdl/launch/warm.py) does before it has a command line: the
    imports of ``main``, TensorFlow's first, and with ``--job_config`` a rehearsal.

    The Keras generation is the one the master settled (the spare inherited its
    environment; ``settle`` checks it again). The rehearsal sets the thread pools, builds a
    throw-away model and computes one gradient on the first records of the training data:
    TensorFlow's and Keras's first-time costs in a process (autograph converting the model
    and the loss, the first trace, the first tf.data pipeline) are paid here, so the real
    model's build and first step take a fraction (0.9 s -> 0.4 s for digits on 2 cores).
    Nothing of it is kept but the process's caches: a failure here is left for ``main`` to
    meet and report. ``assigned()`` says the command line is there: the rest is skipped.
    """
    from elasticdl.model.tf_runtime import load_tensorflow

    load_tensorflow()
    import elasticdl.model.spec  # noqa: F401
    import elasticdl.model.trainer  # noqa: F401
    import elasticdl.rpc.master_client  # noqa: F401
    import elasticdl.rpc.ps_client  # noqa: F401
    import elasticdl.worker.consistency  # noqa: F401
    import elasticdl.worker.worker  # noqa: F401

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--job_config", default="")
    job_config = parser.parse_args(argv).job_config
    if not job_config or assigned():
        return
    try:
        with open(job_config) as f:
            text = f.read()
        config = _settled(JobConfig.from_json(text))
        _WARM.update(config=text, threads=_threads(config))
        configure_tensorflow(_WARM["threads"])
        _rehearse(config, assigned)
    except Exception as err:  # noqa: BLE001  (main meets it again, and reports it)
        logger.debug("the warm spare's rehearsal failed: %s", err)


def _settled(config: JobConfig) -> JobConfig:
    from elasticdl.model.keras_generation import settle

    return settle(config, announce=False)


def _threads(config: JobConfig) -> int:
    return config.training.num_threads_per_process or default_threads(config.elasticity.num_workers)


def _rehearse(config: JobConfig, assigned) -> None:
    import itertools

    from elasticdl.data.sources import read_columns, read_records, record_format, resolve_data_files
    from elasticdl.mode import Mode
    from elasticdl.model.sample_weight import unpack
    from elasticdl.model.spec import DatasetMetadata, load_model_spec
    from elasticdl.model.trainer import Trainer, make_dataset

    spec = load_model_spec(config.training.model_zoo, config.training.model_def,
                           config.model_zoo_functions.names(), config.training.class_weight)
    trainer = Trainer(spec, config.training.model_params, config.training.embedding_swap_threshold_mb)
    if not config.data.training_data or assigned():
        return
    path = resolve_data_files(config.data.training_data)[0]
    n = config.training.minibatch_size
    if config.data.records == "columns":  # as the master's preflight reads them
        records = read_columns(path, 0, n, config.data.columns)
    else:
        records = list(itertools.islice(
            read_records(path, 0, n, config.data.has_header, columns=config.data.columns), n))
    metadata = DatasetMetadata(record_format(path), getattr(records, "names", ()))
    dataset = make_dataset(spec, records, Mode.TRAINING, metadata, len(records))
    batch = unpack(next(iter(dataset)), spec, Mode.TRAINING)
    trainer.ensure_built(batch.features)
    trainer.compute_gradients(*batch)


def main(argv: list[str] | None = None, assigned_at: float | None = None) -> int:
    """``assigned_at``: a warm spare's ``time.monotonic()`` when it got ``argv`` (the clock
    to the first gradient starts there, not at the process's start)."""
    origin = "the process started" if assigned_at is None else "its warm spare got its command line"
    startup = StartupClock(assigned_at, origin)  # where the time to the first gradient goes: logged with it
    startup.mark("python" if assigned_at is None else "spare still importing")
    die_with_parent()
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
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
    try:  # Keras 2 or 3, before TensorFlow is imported: the environment may not carry it (a pod)
        config = _settled(config)
    except REPORTED as err:
        return report_exit(f"elasticdl worker-{args.worker_id}", err)
    threads = _threads(config)
    if _WARM.get("threads") not in (None, threads):  # a rehearsal ran ops: the pools are fixed
        logger.warning("this warm spare runs TensorFlow with %d threads, not %d: its job config changed after "
                       "it started (%s)", _WARM["threads"], threads, args.job_config)
    else:  # imports TensorFlow without its banner (shown with --log_level debug)
        configure_tensorflow(threads)
    startup.mark("tensorflow")

    # Imported after the thread limits: these pull in TensorFlow.
    from elasticdl.model.embedding.swap import swap_policy
    from elasticdl.model.spec import load_model_spec
    from elasticdl.model.trainer import Trainer
    from elasticdl.rpc.master_client import MasterClient
    from elasticdl.rpc.ps_client import PSClient
    from elasticdl.worker.consistency import ConsistencyPolicy
    from elasticdl.worker.worker import Worker

    startup.mark("elasticdl")
    spec = load_model_spec(config.training.model_zoo, config.training.model_def,
                           config.model_zoo_functions.names(), config.training.class_weight)
    from elasticdl.model.preprocessing_state import PreprocessingState, Takeover

    master = MasterClient(args.master_addr, args.worker_id)
    # The master's adapted preprocessing state, not this import's: every worker preprocesses alike.
    takeover = Takeover(spec, PreprocessingState.from_bytes(master.preprocessing_state()))
    takeover.before_build()
    startup.mark("model zoo")
    ps = PSClient(args.ps_addrs.split(","), wire_dtype=config.training.wire_dtype,
                  tensor_transport=config.training.tensor_transport, replicas=config.elasticity.ps_replicas,
                  slice_dense_above_mb=config.training.slice_dense_above_mb)
    trainer = Trainer(spec, config.training.model_params, config.training.embedding_swap_threshold_mb,
                      embedding_policy=swap_policy(config.training))
    takeover.after_build(trainer.model)
    startup.mark("model")
    worker = Worker(
        worker_id=args.worker_id,
        spec=spec,
        trainer=trainer,
        master=master,
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
        progressive=_progressive(config, spec, args.command),
    )
    # Preemption is a scale-down, not a failure: finish the batch, report, leave (exit 0).
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    worker.run()
    return 0


def _progressive(config: JobConfig, spec, command: str):
    """--window_records: the scorer of each training batch (None: off)."""
    if command != "train" or not config.stream.window_records or spec.eval_metrics_fn is None:
        return None
    from elasticdl.worker.progressive import ProgressiveScore

    return ProgressiveScore(spec.eval_metrics_fn)


if __name__ == "__main__":
    exit_now(main())  # see exit_now: a role leaves at once
