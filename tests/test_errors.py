"""The error tree (elasticdl/errors.py) covers every exception class of the package, and
its one mapping gives the programs their messages and exit codes."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import socket

import pytest

import elasticdl
from elasticdl import errors
from elasticdl.errors import ElasticDLError, JobFailure, UserError, exit_status
from elasticdl.launch.api import BackendError
from elasticdl.launch.kubernetes.client import K8sError, K8sForbidden

# Exception classes of the package that are deliberately outside the tree: they never reach
# the user (each is caught and turned into something else where it is raised).
OUTSIDE_THE_TREE = {
    # The simulator's UNAVAILABLE: a simulated role answers it and the simulated caller rides it out.
    "elasticdl.sim.transport.Unavailable",
    # The simulated Kafka broker cut off: the simulated stream source rides it out as the real one does.
    "elasticdl.sim.stream.BrokerDown",
    # A failed compare-and-set inside a store write; becomes LedgerConflictError/LeadershipError.
    "elasticdl.store.api._CasFailed",
    # The memory store's simulated outage; the store's retries turn it into StoreUnavailableError.
    "elasticdl.store.memory._Unavailable",
    # A deposed master's command on the PS; the servicer answers it FAILED_PRECONDITION.
    "elasticdl.ps.server.StaleTermError",
    # A task the master took back; the worker leaves it and takes the next one.
    "elasticdl.worker.consistency.TaskTakenBackError",
    # A request the PS's bulk (raw TCP) server refused; answered to the worker as a status frame.
    "elasticdl.ps.bulk_server._Aborted",
    # A raw-TCP push whose answer was lost; sent again over gRPC with its task's place.
    "elasticdl.rpc.bulk.PushMaybeApplied",
    # A request the master's job loop did not take in time; the worker gets UNAVAILABLE and retries.
    "elasticdl.master.requests.LoopBusy",
    # A primary that cannot snapshot its shard now; the master asks again at a later Tick.
    "elasticdl.ps.replica_snapshot.SnapshotRefused",
    # A backup taken off a shard while a forward was on its way; the primary drops it from the forward.
    "elasticdl.ps.replication.BackupGone",
    # Slices that do not make a whole variable; a damaged checkpoint or a model error where raised.
    "elasticdl.model.slicing.SliceError",
}
# ElasticDLErrors on neither branch: families whose subclasses are on both. Only their
# subclasses are raised (checked below); exit_status maps the family itself to 1.
FAMILIES = {"elasticdl.launch.kubernetes.client.K8sError"}
ROOTS = {"elasticdl.errors.ElasticDLError", "elasticdl.errors.UserError", "elasticdl.errors.JobFailure"}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _package_modules() -> list:
    modules = []
    for info in pkgutil.walk_packages(elasticdl.__path__, "elasticdl."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it would run the CLI
            continue
        modules.append(importlib.import_module(info.name))
    return modules


def _exception_classes() -> dict[str, type]:
    found = {}
    for module in _package_modules():
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[_name(obj)] = obj
    return found


CLASSES = _exception_classes()
USER_ERRORS = sorted(n for n, c in CLASSES.items() if issubclass(c, UserError) and n not in ROOTS)
JOB_FAILURES = sorted(n for n, c in CLASSES.items() if issubclass(c, JobFailure) and n not in ROOTS)


def test_the_walk_finds_the_known_classes():
    for name in ("elasticdl.config.ConfigError", "elasticdl.launch.api.BackendError",
                 "elasticdl.launch.kubernetes.client.K8sForbidden", "elasticdl.store.errors.StateStoreError",
                 "elasticdl.errors.JobFailedError", *OUTSIDE_THE_TREE, *FAMILIES):
        assert name in CLASSES, name


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_exception_class_is_on_exactly_one_branch_or_on_a_list(name):
    cls = CLASSES[name]
    if name in OUTSIDE_THE_TREE:
        assert not issubclass(cls, ElasticDLError), f"{name} joined the tree: take it off OUTSIDE_THE_TREE"
    elif name in FAMILIES:
        assert issubclass(cls, ElasticDLError) and not issubclass(cls, (UserError, JobFailure))
    elif name not in ROOTS:
        assert issubclass(cls, ElasticDLError), (
            f"{name} is not an ElasticDLError: base it on elasticdl.errors.UserError (the input is "
            "wrong, exit 2) or JobFailure (the job could not finish, exit 1), or, if it never reaches "
            "the user, add it to OUTSIDE_THE_TREE with the reason"
        )
        assert issubclass(cls, UserError) != issubclass(cls, JobFailure), f"{name} is on both branches"


def test_each_family_has_children_on_both_branches_and_only_they_are_raised():
    for family in FAMILIES:
        children = [c for c in CLASSES.values() if c is not CLASSES[family] and issubclass(c, CLASSES[family])]
        assert any(issubclass(c, UserError) for c in children)
        assert any(issubclass(c, JobFailure) for c in children)
    short = {f.rsplit(".", 1)[-1] for f in FAMILIES}
    package = pathlib.Path(elasticdl.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                assert name not in short, f"{path}:{node.lineno} raises the family {name}: raise a subclass"


def _bare(cls: type) -> BaseException:
    """An instance without its constructor's arguments (some need a ProcessExit, a path ...)."""
    return cls.__new__(cls)


@pytest.mark.parametrize("name", USER_ERRORS)
def test_user_errors_exit_2(name):
    code, message = exit_status(_bare(CLASSES[name]))
    assert code == 2 and message.startswith("error: ")


@pytest.mark.parametrize("name", JOB_FAILURES)
def test_job_failures_exit_1(name):
    code, message = exit_status(_bare(CLASSES[name]))
    assert code == 1 and message.startswith("job failed: ")


def test_the_mapping():
    assert exit_status(K8sForbidden("RBAC forbids `create` on `pods`", 403)) == (
        2, "error: RBAC forbids `create` on `pods`")
    assert exit_status(BackendError("pod p was not deleted within 30s")) == (
        1, "job failed: pod p was not deleted within 30s")
    assert exit_status(errors.JobFailedError("worker-0 exited")) == (1, "job failed: worker-0 exited")
    assert exit_status(K8sError("a family raised as is")) == (1, "job failed: a family raised as is")
    assert exit_status(UserError()) == (2, "error: UserError")  # no text: the class names it
    assert exit_status(KeyboardInterrupt())[0] == 130
    assert exit_status(ZeroDivisionError("x")) == (1, "internal error: ZeroDivisionError: x")
    # What the programs catch: the tree and Ctrl-C, never a bug.
    assert not issubclass(ZeroDivisionError, errors.REPORTED)
    assert issubclass(KeyboardInterrupt, errors.REPORTED) and issubclass(K8sError, errors.REPORTED)


def test_builtin_bases_that_callers_catch_are_kept():
    from elasticdl.api import MasterUnreachableError
    from elasticdl.config import ConfigError
    from elasticdl.data.errors import DataError
    from elasticdl.rpc.auth import TokenError
    from elasticdl.rpc.codec import TensorDecodeError

    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(TensorDecodeError, ValueError)  # the PS answers INVALID_ARGUMENT
    assert issubclass(K8sError, RuntimeError) and issubclass(BackendError, RuntimeError)
    assert issubclass(TokenError, RuntimeError) and issubclass(MasterUnreachableError, ConnectionError)


# ---------------------------------------------------------------- the programs


@pytest.fixture
def quiet_cli(monkeypatch):
    """cli.main without its process set-up (logging, TensorFlow threads), which would leak
    into the other tests of this process."""
    from elasticdl import cli
    from elasticdl.model import tf_runtime

    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(tf_runtime, "quiet_tensorflow", lambda: None)
    monkeypatch.setattr(tf_runtime, "configure_tensorflow", lambda threads: [])
    return cli


TRAIN = ["train", "--model_zoo", "zoo", "--model_def", "a.b.c", "--training_data", "data"]


def _raising(err: BaseException):
    def run(*args, **kwargs):
        raise err

    return run


@pytest.mark.parametrize("err, code, line", [
    (BackendError("pod p was not deleted within 30s"), 1, "elasticdl train: job failed: pod p was not deleted within 30s"),
    (K8sForbidden("Kubernetes RBAC forbids `create` on `pods`", 403),
     2, "elasticdl train: error: Kubernetes RBAC forbids `create` on `pods`"),
    (errors.JobFailedError("ps-0 failed to start"), 1, "elasticdl train: job failed: ps-0 failed to start"),
])
def test_cli_main_turns_an_error_from_run_into_one_line_and_an_exit_code(quiet_cli, monkeypatch, capsys,
                                                                       err, code, line):
    import elasticdl.api

    monkeypatch.setattr(elasticdl.api, "run", _raising(err))
    assert quiet_cli.main(TRAIN) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


def test_cli_main_ctrl_c_is_130_and_a_bug_keeps_its_traceback(quiet_cli, monkeypatch, capsys):
    import elasticdl.api

    monkeypatch.setattr(elasticdl.api, "run", _raising(KeyboardInterrupt()))
    assert quiet_cli.main(TRAIN) == 130
    assert "interrupted" in capsys.readouterr().err
    monkeypatch.setattr(elasticdl.api, "run", _raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        quiet_cli.main(TRAIN)


def test_scale_without_a_job_exits_2(quiet_cli, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert quiet_cli.main(["scale", "--job_name", "nojob", "--num_workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl scale: error: no running job 'nojob' here") and err.count("\n") == 1


def test_scale_with_no_master_at_the_address_is_a_user_error():
    from elasticdl.api import MasterUnreachableError, scale

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MasterUnreachableError, match="is job 'gone' running") as info:
        scale("gone", 2, master_addr=f"127.0.0.1:{port}", timeout=0.3)
    assert exit_status(info.value)[0] == 2 and isinstance(info.value, ConnectionError)


@pytest.fixture
def master_pod_env(monkeypatch):
    """master_main's environment (what the client's manifest sets), with no cluster."""
    from elasticdl.cli import master_pod as master_main
    from elasticdl.config import JobConfig
    from elasticdl.launch.kubernetes import backend as k8s_backend
    from elasticdl.launch.kubernetes import client, manifests
    from elasticdl.model import tf_runtime

    config = JobConfig.from_flags(model_zoo="/model_zoo", model_def="a.b.c", training_data="/data",
                       backend="kubernetes", job_name="errors").with_defaults()
    monkeypatch.setenv(manifests.JOB_CONFIG_ENV, config.to_json())
    monkeypatch.setenv(manifests.POD_NAME_ENV, "elasticdl-errors-master")
    monkeypatch.setenv(manifests.POD_UID_ENV, "uid-1")
    monkeypatch.setattr(master_main, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(tf_runtime, "quiet_tensorflow", lambda: None)
    monkeypatch.setattr(tf_runtime, "configure_tensorflow", lambda threads: [])
    monkeypatch.setattr(client, "K8sClient", lambda namespace: object())
    monkeypatch.setattr(k8s_backend, "KubernetesBackend", lambda *args, **kwargs: object())
    return master_main


@pytest.mark.parametrize("err, code, line", [
    (BackendError("service elasticdl-errors-ps-0 has no cluster IP"),
     1, "elasticdl train: job failed: service elasticdl-errors-ps-0 has no cluster IP"),
    (K8sForbidden("Kubernetes RBAC forbids `create` on `pods`", 403),
     2, "elasticdl train: error: Kubernetes RBAC forbids `create` on `pods`"),
])
def test_master_main_turns_an_error_from_run_into_one_line_and_an_exit_code(master_pod_env, monkeypatch,
                                                                          capsys, err, code, line):
    import elasticdl.api

    monkeypatch.setattr(elasticdl.api, "run", _raising(err))
    assert master_pod_env.main(["--command", "train"]) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and master_pod_env.REPORT_MARKER not in captured.out


def test_master_main_outside_its_pod_exits_2(master_pod_env, monkeypatch, capsys):
    from elasticdl.launch.kubernetes import manifests
    monkeypatch.delenv(manifests.JOB_CONFIG_ENV)
    assert master_pod_env.main(["--command", "train"]) == 2
    assert capsys.readouterr().err.startswith("elasticdl train: error: $ELASTICDL_JOB_CONFIG is not set")


class _EndedMaster:
    """A K8sClient whose master pod has ended with ``exit_code`` after logging ``lines``."""

    def __init__(self, exit_code: int, lines: list[str]):
        self.exit_code, self.lines = exit_code, lines

    def get_pod(self, name):
        terminated = {"exitCode": self.exit_code, "reason": "Error"}
        return {"metadata": {"name": name},
                "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": terminated}}]}}

    def follow_log(self, name):
        return iter(self.lines)


@pytest.mark.parametrize("pod_exit, error, code", [(2, "MasterRefusedError", 2), (1, "JobFailedError", 1)])
def test_the_client_exits_with_the_master_pods_code(pod_exit, error, code, capsys):
    from elasticdl.launch.kubernetes.submit import follow

    last = "elasticdl train: error: no data files found for '/data'"
    with pytest.raises(ElasticDLError) as info:
        follow(_EndedMaster(pod_exit, [last]), "elasticdl-errors-master")
    assert type(info.value).__name__ == error and exit_status(info.value)[0] == code
    assert last in str(info.value) and last in capsys.readouterr().err  # streamed, then quoted


def test_scale_on_a_job_that_has_ended_says_so_at_once(quiet_cli, monkeypatch, tmp_path, capsys):
    """The master removes master.addr when it exits and leaves report.json: no 10 s wait for a
    master that is not there, and no 'no server answered'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "done").mkdir(parents=True)
    (tmp_path / "runs" / "done" / "report.json").write_text('{"status": "succeeded"}')
    assert quiet_cli.main(["scale", "--job_name", "done", "--num_workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl scale: error: job 'done' has ended (succeeded): there is nothing to scale")
