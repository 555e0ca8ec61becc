"""The Python API: ``elasticdl.train(...)`` mirrors ``elasticdl train`` flag for flag.

Example::

    import elasticdl
    report = elasticdl.train(
        model_zoo="model_zoo", model_def="digits.digits_functional.custom_model",
        training_data="data/digits/train", num_workers=2, num_ps=1, output="out/model",
    )
    print(report.metrics, report.saved_model)
"""

from __future__ import annotations

import logging
import os
import shutil

from elasticdl.config import ConfigError, JobConfig, check_job_name
from elasticdl.errors import UserError

logger = logging.getLogger(__name__)


class MasterUnreachableError(UserError, ConnectionError):
    """`scale` found no master at the job's address: the job is not running, or
    --job_name/--master_addr names another one."""


class ScaleTokenError(UserError, PermissionError):
    """`scale` has no token for the job, or the master refused it (UNAUTHENTICATED): the
    token file is not this job's, or this user may not read it."""


def make_config(**flags) -> JobConfig:
    """A JobConfig from keyword arguments named like the CLI flags (unknown names: ConfigError)."""
    return JobConfig.from_flags(**flags).with_defaults()


def run(config: JobConfig, command: str = "train", backend=None, before_tensorflow=None):
    """Check the job, then run it on the configured backend; returns a JobReport.

    With ``backend="kubernetes"`` and no ``backend`` object, this is the client: it submits
    the master pod (see elasticdl/launch/kubernetes/submit.py); the master pod runs this with its backend.
    ``before_tensorflow`` runs once the checks that need no TensorFlow passed (the CLI loads
    and limits TensorFlow there).
    """
    if config.job.backend == "kubernetes" and backend is None:
        from elasticdl.launch.kubernetes.submit import submit

        return submit(config, command)
    config.validate(command)  # flags first: no TensorFlow import for a typo
    from elasticdl.model.keras_generation import settle

    config = settle(config)  # Keras 2 or 3, before TensorFlow is imported
    from elasticdl.model.tf_runtime import quiet_tensorflow

    quiet_tensorflow()
    from elasticdl.master.job import Job, default_backend, prewarm
    from elasticdl.master.preflight import check_job

    new_dirs = _missing_dirs(config.job.run_dir, config.job.effective_log_dir)
    backend = backend or default_backend(config)

    def get_ready() -> None:
        # Once the checks that need no TensorFlow passed: the roles start importing it
        # while this process checks the model (a worker's first gradient comes seconds sooner).
        prewarm(backend, config)
        if before_tensorflow is not None:
            before_tensorflow()

    try:
        checked = check_job(config, command, get_ready)
    except BaseException:
        # A job that will not run leaves nothing behind: not its spares, nor runs/<job>.
        backend.stop_all()
        for path in new_dirs:
            shutil.rmtree(path, ignore_errors=True)
        raise
    logger.info(
        "%s job %s: %d records in %d files, %d workers, %d PS",
        command, config.job.job_name, sum(n for _, n in checked.files), len(checked.files),
        config.elasticity.num_workers, config.elasticity.num_ps,
    )
    return Job(checked, command, backend=backend).run()


def _missing_dirs(*paths: str) -> list[str]:
    """For each path, its outermost ancestor (or itself) that does not exist yet."""
    missing = []
    for path in paths:
        path, top = os.path.abspath(path), None
        while not os.path.exists(path):
            top, path = path, os.path.dirname(path)
        if top is not None and top not in missing:
            missing.append(top)
    return missing


def train(**flags):
    """Train a model-zoo model; keyword arguments are the ``elasticdl train`` flags."""
    return run(make_config(**flags), "train")


def evaluate(**flags):
    """Evaluate a checkpoint (--checkpoint_dir_for_init) over --validation_data."""
    return run(make_config(**flags), "evaluate")


def predict(**flags):
    """Predict with a checkpoint over --prediction_data; see --prediction_outputs."""
    return run(make_config(**flags), "predict")


def _job_token(run_dir: str, job_name: str) -> str:
    """The token the job's master wrote to runs/<job>/token (0600), else $ELASTICDL_TOKEN_FILE's."""
    from elasticdl.rpc import auth

    path = os.path.join(run_dir, auth.TOKEN_FILE_NAME)
    try:
        if os.path.exists(path):
            return auth.read_token_file(path, "the job's token file")
        token = auth.job_token()
    except auth.TokenError as err:
        raise ScaleTokenError(str(err)) from None
    if token is None:
        raise ScaleTokenError(
            f"no token for job {job_name!r}: {path} does not exist and ${auth.TOKEN_FILE_ENV} is not set. "
            "Every call to a job needs the token its master wrote there: run this where the job was started, "
            f"as the user who started it, or set ${auth.TOKEN_FILE_ENV}."
        )
    return token


def _no_master_addr(job_name: str, run_dir: str, addr_file: str, what: str = "scale") -> str:
    """Why there is no master to ask: the job ended (its master removes master.addr on exit
    and leaves report.json), or it never ran here."""
    import json

    report_file = os.path.join(run_dir, "report.json")
    try:
        with open(report_file) as f:
            status = json.load(f).get("status", "ended")
    except (OSError, ValueError):
        return (f"no running job {job_name!r} here: {addr_file} does not exist. Run this where the job "
                "was started, or pass --master_addr.")
    return f"job {job_name!r} has ended ({status}): there is nothing to {what}. Its report: {report_file}"


def scale(job_name: str, num_workers: int, master_addr: str = "", timeout: float = 10.0) -> str:
    """Change the number of workers of a running training job; returns the master's answer.

    Example::

        elasticdl.scale(job_name="digits-demo", num_workers=4)
    """
    from elasticdl.proto import elasticdl_pb2

    return _ask_master(job_name, master_addr, timeout, "scale",
                       lambda stub: stub.scale(elasticdl_pb2.ScaleRequest(num_workers=num_workers), timeout=timeout))


def stop(job_name: str, master_addr: str = "", timeout: float = 10.0) -> str:
    """End a running training job early: the tasks in progress finish, then the final checkpoint,
    export and report, as when it finishes (a stream job takes no new record). Returns the
    master's answer; the job's command exits when the job has ended.

    Example::

        elasticdl.stop(job_name="clicks-online")
    """
    from elasticdl.proto import elasticdl_pb2

    return _ask_master(job_name, master_addr, timeout, "stop",
                       lambda stub: stub.stop(elasticdl_pb2.StopRequest(reason="elasticdl stop"), timeout=timeout))


def _ask_master(job_name: str, master_addr: str, timeout: float, what: str, ask) -> str:
    """``ask(MasterStub)`` of the job's master (found by ``job_name`` in runs/, or at
    ``master_addr``), with the job's token; the master's answer, or ConfigError with its refusal."""
    import grpc

    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc.channel import make_channel, wait_for_channel

    check_job_name(job_name)  # never a path: runs/../../x would read outside runs/
    run_dir = os.path.join("runs", job_name)
    if not master_addr:
        addr_file = os.path.join(run_dir, "master.addr")
        if not os.path.exists(addr_file):
            raise ConfigError(_no_master_addr(job_name, run_dir, addr_file, what))
        master_addr = open(addr_file).read().strip()
    token = _job_token(run_dir, job_name)
    channel = make_channel(master_addr, token)
    try:
        wait_for_channel(channel, master_addr, timeout)
        reply = ask(elasticdl_pb2_grpc.MasterStub(channel))
    except ConnectionError as err:
        raise MasterUnreachableError(f"{err}: is job {job_name!r} running?") from None
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNAUTHENTICATED:
            raise
        raise ScaleTokenError(
            f"the master at {master_addr} refused our token for job {job_name!r}: it is not this job's "
            "(a job restarted since, or --master_addr names another job). Run this where the job was started."
        ) from None
    finally:
        channel.close()
    if not reply.accepted:
        raise ConfigError(reply.message)
    return reply.message
