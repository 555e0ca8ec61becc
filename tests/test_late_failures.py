"""Late failures (issue 15): what a job writes is checked before it starts, a failing end
still leaves report.json, and a checkpoint that cannot be written never fails a push."""

from __future__ import annotations

import errno
import json
import os
import threading
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from elasticdl.config import ConfigError, JobConfig
from elasticdl.config import paths as config_paths
from elasticdl.errors import JobFailedError
from elasticdl.model import checkpoint
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc.ps_client import PSStats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")


def config(tmp_path, **flags) -> JobConfig:
    flags = {"model_zoo": MODEL_ZOO, "model_def": "digits.digits_functional.custom_model",
             "training_data": str(tmp_path / "train"), "job_name": "late", **flags}
    return JobConfig.from_flags(**flags).with_defaults()


def a_file(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a directory")
    return str(path)


def listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


# ---------------------------------------------------------------- directories, at submit time


@pytest.mark.parametrize("command, flag", [
    ("train", "output"), ("train", "checkpoint_dir"), ("train", "tensorboard_log_dir"), ("train", "log_dir"),
    ("evaluate", "tensorboard_log_dir"), ("predict", "prediction_outputs"), ("predict", "log_dir"),
])
def test_a_directory_flag_that_is_a_file_fails_the_submit(tmp_path, monkeypatch, command, flag):
    monkeypatch.chdir(tmp_path)
    path = a_file(tmp_path / "taken")
    extra = {"validation_data": "v", "checkpoint_dir_for_init": str(tmp_path)} if command != "train" else {}
    if command == "predict":
        extra["prediction_data"] = "p"
    cfg = config(tmp_path, **extra, **{flag: path})
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=rf"--{flag} '{path}' is a file, not a directory"):
        cfg.validate(command)
    assert listing(tmp_path) == before  # nothing created


def test_a_directory_under_a_file_cannot_be_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocker = a_file(tmp_path / "blocker")
    cfg = config(tmp_path, checkpoint_dir=os.path.join(blocker, "ckpt", "deeper"))
    with pytest.raises(ConfigError, match=rf"--checkpoint_dir .* cannot be created: '{blocker}' is a file"):
        cfg.validate("train")


def test_the_jobs_own_directory_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file(tmp_path / "runs" / "late")
    with pytest.raises(ConfigError, match=r"runs/<job_name> \(the job's directory\) 'runs/late' is a file"):
        config(tmp_path).validate("train")


def test_an_unwritable_directory_fails_the_submit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # The tests run as root, whom permission bits do not stop: the check asks os.access.
    monkeypatch.setattr(config_paths.os, "access", lambda p, mode: p != str(locked) and real_access(p, mode))
    with pytest.raises(ConfigError, match=rf"--output '{locked}' is not writable by this user"):
        config(tmp_path, output=str(locked)).validate("train")
    with pytest.raises(ConfigError, match=rf"--output '{locked}/model' cannot be created: '{locked}' is not writable"):
        config(tmp_path, output=str(locked / "model")).validate("train")


def test_a_full_disk_fails_the_submit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    real_usage = config_paths.shutil.disk_usage

    def usage(path):
        u = real_usage(path)
        return u._replace(free=512) if str(path).startswith(str(full)) else u

    monkeypatch.setattr(config_paths.shutil, "disk_usage", usage)
    with pytest.raises(ConfigError, match=r"--checkpoint_dir .*: the disk holding .* has 512 bytes free, "
                                          r"and the job needs at least 1.00 MiB there"):
        config(tmp_path, checkpoint_dir=str(full / "ckpt")).validate("train")
    config(tmp_path, checkpoint_dir=str(tmp_path / "elsewhere")).validate("train")  # another disk: fine


def test_the_checkpoint_dir_needs_room_for_one_checkpoint_of_the_model(tmp_path, monkeypatch):
    from elasticdl.master import preflight
    from elasticdl.model.optimizers import OptimizerSpec

    monkeypatch.setattr(config_paths.shutil, "disk_usage", lambda p: SimpleNamespace(free=(1 << 20) + 2000))
    variable = SimpleNamespace(numpy=lambda: np.zeros(1000, np.float32))  # 4000 bytes
    trainer = SimpleNamespace(variables={"w": variable}, non_trainable={})
    cfg = config(tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    # Adam keeps two slots per variable: a checkpoint is 3 x 4000 bytes.
    with pytest.raises(ConfigError, match=r"--checkpoint_dir .* has 1.00 MiB free, and the job needs at least "
                                          r"1.01 MiB there"):
        preflight._check_room_for_the_model(cfg, OptimizerSpec("Adam", {"learning_rate": 0.1}), trainer)
    variable = SimpleNamespace(numpy=lambda: np.zeros(100, np.float32))
    preflight._check_room_for_the_model(cfg, OptimizerSpec("Adam", {"learning_rate": 0.1}),
                                        SimpleNamespace(variables={"w": variable}, non_trainable={}))


def test_paths_are_not_checked_where_they_name_files_in_pods(tmp_path, monkeypatch):
    """The Kubernetes client does not look at local paths (check_paths=False)."""
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, output=a_file(tmp_path / "taken"), model_zoo="/in/the/image")
    cfg.validate("train", check_paths=False)


def test_the_master_pod_checks_the_paths_before_the_job_starts(tmp_path, monkeypatch, capsys):
    """In the cluster the paths are checked where they are: in the master pod, which mounts the
    job's volumes as every pod does, before it creates any."""
    from elasticdl.cli import master_pod
    from elasticdl.launch.kubernetes import backend as k8s_backend
    from elasticdl.launch.kubernetes import client, manifests
    from elasticdl.master import job as job_module
    from elasticdl.model import tf_runtime

    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, backend="kubernetes", image_name="img:1", output=a_file(tmp_path / "model"))
    monkeypatch.setenv(manifests.JOB_CONFIG_ENV, cfg.to_json())
    monkeypatch.setenv(manifests.POD_NAME_ENV, "elasticdl-late-master")
    monkeypatch.setenv(manifests.POD_UID_ENV, "uid-1")
    monkeypatch.setattr(master_pod, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(tf_runtime, "quiet_tensorflow", lambda: None)
    monkeypatch.setattr(tf_runtime, "configure_tensorflow", lambda threads: [])
    monkeypatch.setattr(client, "K8sClient", lambda namespace: object())
    monkeypatch.setattr(k8s_backend, "KubernetesBackend", lambda *args, **kwargs: object())
    monkeypatch.setattr(job_module, "Job", None)  # never reached
    assert master_pod.main(["--command", "train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl train: error: --output ") and "is a file, not a directory" in err


# ---------------------------------------------------------------- job names


@pytest.mark.parametrize("name", ["../../x", "a/b", "Digits_1", "my job", "-job", "job-", "x" * 64, ".hidden"])
def test_job_names_are_dns_labels(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--job_name .* is not a valid job name.*lower-case letters, digits "
                                          r"and '-'.*at most 63 characters, like '[a-z0-9-]+'"):
        config(tmp_path, job_name=name).validate("train", check_paths=False)
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()


def test_a_path_as_job_name_says_why(tmp_path):
    with pytest.raises(ConfigError, match=r"a path would write outside runs/"):
        config(tmp_path, job_name="../../x").validate("train", check_paths=False)


@pytest.mark.parametrize("name", ["digits-demo", "j", "e2e", "1st-run", "x" * 63])
def test_valid_job_names_pass(tmp_path, name):
    config(tmp_path, job_name=name).validate("train", check_paths=False)


@pytest.mark.parametrize("model_def", ["digits.digits_functional.custom_model", "My_Pkg.Sub.mod.fn",
                                       "a" * 80 + ".m.f", "__.m.f"])
def test_default_job_names_are_valid_on_every_backend(tmp_path, model_def):
    from elasticdl.config.kubernetes import MAX_PREFIX

    cfg = JobConfig.from_flags(model_def=model_def).with_defaults()
    config_paths.check_job_name(cfg.job.job_name)
    assert cfg.job.job_name.startswith("elasticdl-") and len(cfg.job.job_name) <= MAX_PREFIX


def test_the_cli_refuses_a_bad_job_name_with_exit_2(tmp_path, monkeypatch, capsys):
    from elasticdl import cli
    from elasticdl.model import tf_runtime

    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)  # would leak into other tests
    monkeypatch.setattr(tf_runtime, "quiet_tensorflow", lambda: None)
    monkeypatch.setattr(tf_runtime, "configure_tensorflow", lambda threads: [])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--model_zoo", MODEL_ZOO, "--model_def", "digits.digits_functional.custom_model",
                     "--training_data", "d", "--job_name", "../../x"]) == 2
    assert "elasticdl train: error: --job_name '../../x' is not a valid job name" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_scale_refuses_a_path_as_job_name(tmp_path, monkeypatch):
    from elasticdl.api import scale

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--job_name '../x' is not a valid job name"):
        scale("../x", 2)


# ---------------------------------------------------------------- atomic checkpoint files


def test_a_failed_write_leaves_no_partial_file_and_the_old_one_intact(tmp_path):
    target = tmp_path / "ps-0-of-1.npz"
    target.write_bytes(b"the old checkpoint")

    def half_then_full(f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.write_atomically(str(target), half_then_full)
    assert os.listdir(tmp_path) == ["ps-0-of-1.npz"] and target.read_bytes() == b"the old checkpoint"


def shard_state(version: int = 3) -> checkpoint.ShardState:
    return checkpoint.ShardState(version, version, {"w": np.ones(3, np.float32)}, {"w": {}})


def test_save_shard_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    path = checkpoint.save_shard(str(tmp_path), 0, 1, shard_state())
    assert events == [("fsync", "dir"), ("fsync", "file"), ("rename", "ps-0-of-1.npz"), ("fsync", "dir")]
    assert checkpoint.load_shard(str(tmp_path), 0, 1).version == 3 and os.listdir(os.path.dirname(path)) == [
        "ps-0-of-1.npz"]


def test_save_shard_into_a_file_raises_a_checkpoint_write_error(tmp_path):
    blocker = a_file(tmp_path / "ckpt")
    with pytest.raises(checkpoint.CheckpointWriteError, match=rf"could not write checkpoint {blocker}/version-3/"):
        checkpoint.save_shard(blocker, 0, 1, shard_state())


def test_a_disk_that_fills_mid_write_leaves_no_shard_file(tmp_path, monkeypatch):
    real_savez = np.savez

    def savez(f, **arrays):
        real_savez(f, **arrays)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.np, "savez", savez)
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left on device"):
        checkpoint.save_shard(str(tmp_path), 0, 1, shard_state())
    assert listing(tmp_path) == ["version-3"]  # an empty version directory is never complete
    assert checkpoint.complete_versions(str(tmp_path)) == []


# ---------------------------------------------------------------- the PS: a failed checkpoint never fails a push


def make_ps(tmp_path, **settings) -> ParameterServer:
    from elasticdl.model.optimizers import OptimizerSpec, make_optimizer

    settings = {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_steps": 1, **settings}
    ps = ParameterServer(PSSettings(**settings), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})))
    ps.push_model({"w": np.zeros(4, np.float32)})
    return ps


def push(ps: ParameterServer, encode=None):
    return ps.push_gradients({"w": np.ones(4, np.float32)}, ps.shard.version, None, encode)


def failing_writes(monkeypatch, times: int) -> list:
    """The next ``times`` shard writes fail as on a full disk; returns the versions attempted."""
    attempts = []
    real = checkpoint.save_shard

    def save_shard(directory, ps_id, num_ps, state):
        attempts.append(state.version)
        if len(attempts) <= times:
            raise checkpoint.CheckpointWriteError(f"could not write checkpoint {directory}: No space left on device")
        return real(directory, ps_id, num_ps, state)

    monkeypatch.setattr(checkpoint, "save_shard", save_shard)
    return attempts


@pytest.mark.parametrize("encoded", [False, True])
def test_a_failed_checkpoint_write_leaves_the_push_applied(tmp_path, monkeypatch, caplog, encoded):
    ps = make_ps(tmp_path)
    attempts = failing_writes(monkeypatch, times=1)
    encode = (lambda result, params: (result, None if params is None else dict(params))) if encoded else None
    answer = push(ps, encode)
    result = answer[0] if encoded else answer
    assert result.applied and result.accepted and result.version == 1
    assert ps.shard.version == 1 and np.allclose(ps.shard.params["w"], -0.1)
    assert attempts == [1] and ps.checkpoint_health() == (1, f"could not write checkpoint {tmp_path / 'ckpt'}: "
                                                             "No space left on device")
    assert "the next checkpoint tries again" in caplog.text
    # The next checkpoint retries, and succeeds.
    assert push(ps, encode) is not None and ps.shard.version == 2
    assert attempts == [1, 2] and checkpoint.complete_versions(str(tmp_path / "ckpt")) == [2]
    assert ps.checkpoint_health()[0] == 1


def test_even_an_unexpected_writer_error_leaves_the_push_applied(tmp_path, monkeypatch):
    ps = make_ps(tmp_path)

    def broken(*args):
        raise ValueError("a bug in the writer")

    monkeypatch.setattr(checkpoint, "save_shard", broken)
    result = push(ps)
    assert result.applied and ps.shard.version == 1
    assert ps.checkpoint_health() == (1, "could not write checkpoint version 1: ValueError: a bug in the writer")


def test_a_checkpoint_dir_that_becomes_unwritable_does_not_stop_training(tmp_path):
    ps = make_ps(tmp_path)
    push(ps)
    ckpt = tmp_path / "ckpt"
    assert checkpoint.complete_versions(str(ckpt)) == [1]
    moved = tmp_path / "ckpt-moved"
    ckpt.rename(moved)
    a_file(ckpt)  # the directory is now a file: every write fails
    for version in (2, 3):
        result = push(ps)
        assert result.applied and ps.shard.version == version
    failures, error = ps.checkpoint_health()
    assert failures == 2 and error.startswith(f"could not write checkpoint {ckpt}/version-3")
    ckpt.unlink()
    moved.rename(ckpt)
    assert push(ps).applied
    assert checkpoint.complete_versions(str(ckpt)) == [1, 4]  # the next checkpoint was written


def test_checkpoints_are_written_off_the_lock_from_a_copy(tmp_path, monkeypatch):
    ps = make_ps(tmp_path, checkpoint_steps=2)
    push(ps)
    seen = {}
    real = checkpoint.save_shard

    def save_shard(directory, ps_id, num_ps, state):
        free = ps._lock.acquire(blocking=False)  # another thread could pull or push now
        if free:
            ps._lock.release()
        seen.update(lock_free=free, copy=state.params["w"] is not ps.shard.params["w"])
        # An update racing the write (in another thread: the lock is free) changes the live
        # arrays, not what is written.
        pusher = threading.Thread(target=push, args=(ps,))
        pusher.start()
        pusher.join()
        seen["raced"] = ps.shard.version
        return real(directory, ps_id, num_ps, state)

    monkeypatch.setattr(checkpoint, "save_shard", save_shard)
    push(ps)
    assert seen == {"lock_free": True, "copy": True, "raced": 3}
    monkeypatch.setattr(checkpoint, "save_shard", real)
    written = checkpoint.load_shard(str(tmp_path / "ckpt" / "version-2"), 0, 1)
    assert written.version == 2 and np.allclose(written.params["w"], -0.2)
    assert np.allclose(ps.shard.params["w"], -0.3)


def test_the_final_checkpoint_reports_its_failure(tmp_path, monkeypatch):
    ps = make_ps(tmp_path, checkpoint_steps=0)
    push(ps)
    failing_writes(monkeypatch, times=1)
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left on device"):
        ps.save_checkpoint()
    assert ps.checkpoint_health()[0] == 1
    assert ps.save_checkpoint() == f"{tmp_path / 'ckpt'}/version-1"  # tried again, written


def test_the_grpc_edge_reports_checkpoint_failures(tmp_path, monkeypatch):
    from elasticdl.rpc import channel as grpc_utils
    from elasticdl.rpc.ps_client import PSClient

    ps = make_ps(tmp_path, checkpoint_steps=0)
    push(ps)
    server = grpc_utils.make_server(max_workers=2)
    grpc_utils.add_service(server, "PServer", PServerServicer(ps))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    client = PSClient([f"127.0.0.1:{port}"])
    try:
        failing_writes(monkeypatch, times=1)
        with pytest.raises(grpc.RpcError) as info:
            client.save_checkpoint()
        assert info.value.code() == grpc.StatusCode.INTERNAL and "No space left on device" in info.value.details()
        [stats] = client.stats()
        assert stats.checkpoint_failures == 1 and "No space left on device" in stats.checkpoint_error
        assert stats.version == 1 and stats.pushes_accepted == 1
    finally:
        client.close()
        server.stop(grace=None)


def test_the_master_counts_checkpoint_failures_across_ps_relaunches():
    from elasticdl.master.report import CheckpointFailures

    def stats(*counts):
        return [PSStats(1, 0, 0, 0, {}, 1, n, f"ps {i} failed {n}" if n else "") for i, n in enumerate(counts)]

    seen = CheckpointFailures()
    assert seen.note(stats(0, 0)) == []
    assert seen.note(stats(1, 0)) == ["PS 0: ps 0 failed 1"]
    assert seen.note(stats(1, 0)) == []  # nothing new
    assert seen.note(stats(3, 2)) == ["PS 0: ps 0 failed 3", "PS 1: ps 1 failed 2"]
    assert seen.note(stats(1, 2)) == ["PS 0: ps 0 failed 1"]  # PS 0 was relaunched: it counts from 0
    assert seen.total == 1 + 2 + 2 + 1
    assert seen.errors == ["ps 0 failed 1", "ps 0 failed 3", "ps 1 failed 2"]


# ---------------------------------------------------------------- report.json, whatever the end


class FakeBackend:
    def __init__(self):
        self.stopped = False

    def stop_all(self):
        self.stopped = True


class RpcFailure(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return "could not write checkpoint ckpt/version-9/ps-0-of-1.npz: No space left on device"


class FakePS:
    def __init__(self, fail_checkpoint: bool):
        self.fail_checkpoint = fail_checkpoint

    def save_checkpoint(self):
        if self.fail_checkpoint:
            raise RpcFailure()
        return ["ckpt/version-9"]

    def stats(self):
        return [PSStats(9, 5, 0, 0, {0: 5}, 1, 2, "could not write checkpoint ckpt/version-4: disk full")]

    def close(self):
        pass


def a_job(tmp_path, monkeypatch, command: str, fail_checkpoint: bool = False, **flags):
    """A Job whose start and loop are skipped: only its end (_finish) and run() are real."""
    from elasticdl.master import job as job_module
    from elasticdl.master.preflight import CheckedJob

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.csv"
    data.write_text("".join(f"{i}\n" for i in range(8)))
    extra = {"prediction_data": str(data), "checkpoint_dir_for_init": str(tmp_path)} if command == "predict" else {}
    cfg = config(tmp_path, training_data=str(data), **extra, **flags)
    spec = SimpleNamespace(prediction_outputs_processor=None, callbacks=None)
    backend = FakeBackend()
    job = job_module.Job(CheckedJob(cfg, spec, None, [(str(data), 8)], None), command, backend=backend)
    job._ps = FakePS(fail_checkpoint)
    job.callbacks = SimpleNamespace(on_train_end=lambda logs: None)
    monkeypatch.setattr(job, "_start", lambda: None)
    monkeypatch.setattr(job, "_loop", lambda: None)
    monkeypatch.setattr(job, "_sync_model", lambda: 9)
    monkeypatch.setattr(job, "_serving_model", lambda: object())
    return job, backend


def read_report(tmp_path) -> dict:
    return json.loads((tmp_path / "runs" / "late" / "report.json").read_text())


def test_a_failed_final_checkpoint_still_writes_the_report(tmp_path, monkeypatch):
    job, backend = a_job(tmp_path, monkeypatch, "train", fail_checkpoint=True, checkpoint_dir="ckpt")
    with pytest.raises(JobFailedError, match=r"the final checkpoint in --checkpoint_dir ckpt failed: could not "
                                             r"write checkpoint .*No space left on device"):
        job.run()
    report = read_report(tmp_path)
    assert report["status"] == "failed" and report["failed_step"] == "final checkpoint"
    assert report["exit_code"] == 1 and report["error"].startswith("job failed: the final checkpoint")
    assert report["model_version"] == 9 and report["checkpoint"] == ""
    assert report["checkpoint_failures"] == 2 and report["checkpoint_errors"] == [
        "could not write checkpoint ckpt/version-4: disk full"]
    assert backend.stopped


def test_a_failed_export_still_writes_the_report(tmp_path, monkeypatch):
    from elasticdl.model import export

    def full_disk(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(export, "export_saved_model", full_disk)
    job, _ = a_job(tmp_path, monkeypatch, "train", checkpoint_dir="ckpt", output="model")
    with pytest.raises(JobFailedError, match=r"exporting the SavedModel to --output model failed: .*No space left"):
        job.run()
    report = read_report(tmp_path)
    assert report["status"] == "failed" and report["failed_step"] == "export" and report["exit_code"] == 1
    assert report["checkpoint"] == "ckpt/version-9"  # what was done before the failure is reported
    assert report["report_file"] == str(tmp_path / "runs" / "late" / "report.json")


def test_a_failing_callback_at_the_end_keeps_its_error_and_the_report_names_it(tmp_path, monkeypatch):
    job, _ = a_job(tmp_path, monkeypatch, "train")

    def on_train_end(logs):
        raise ValueError("the user's callback broke")

    job.callbacks = SimpleNamespace(on_train_end=on_train_end)
    with pytest.raises(ValueError, match="the user's callback broke"):  # a bug keeps its traceback
        job.run()
    report = read_report(tmp_path)
    assert report["failed_step"] == "on_train_end" and report["exit_code"] == 1
    assert report["error"] == "internal error: ValueError: the user's callback broke"


def test_a_failed_prediction_join_still_writes_the_report(tmp_path, monkeypatch):
    job, _ = a_job(tmp_path, monkeypatch, "predict")
    with pytest.raises(JobFailedError, match=r"joining the predictions in --prediction_outputs .* failed: "
                                             r"1 prediction tasks wrote no output"):
        job.run()
    report = read_report(tmp_path)
    assert report["status"] == "failed" and report["failed_step"] == "prediction join"
    assert report["command"] == "predict" and report["predictions"] == ""


def test_a_failure_during_the_job_writes_the_report_too(tmp_path, monkeypatch):
    job, _ = a_job(tmp_path, monkeypatch, "train")

    def loop():
        raise JobFailedError("worker 0 failed 3 times")

    monkeypatch.setattr(job, "_loop", loop)
    with pytest.raises(JobFailedError, match="worker 0 failed 3 times"):
        job.run()
    report = read_report(tmp_path)
    assert report["failed_step"] == "training" and report["error"] == "job failed: worker 0 failed 3 times"


def test_a_report_that_cannot_be_written_never_hides_the_jobs_error(tmp_path, monkeypatch, caplog):
    job, _ = a_job(tmp_path, monkeypatch, "train")
    monkeypatch.setattr(job, "_loop", lambda: (_ for _ in ()).throw(JobFailedError("the PS died")))
    from elasticdl.master import report as report_module

    def no_room(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_module.JobReport, "write", no_room)
    with pytest.raises(JobFailedError, match="the PS died"):
        job.run()
    assert "could not write the job's report" in caplog.text


def test_a_successful_job_reports_success(tmp_path, monkeypatch):
    job, _ = a_job(tmp_path, monkeypatch, "train", checkpoint_dir="ckpt")
    report = job.run()
    saved = read_report(tmp_path)
    assert saved == json.loads(report.to_json())
    assert saved["status"] == "succeeded" and saved["failed_step"] == "" and saved["exit_code"] == 0
    assert saved["checkpoint"] == "ckpt/version-9"
    assert not [n for n in os.listdir(tmp_path / "runs" / "late") if n.endswith(".tmp")]


class _PSAway(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "failed to connect to all addresses; Connection refused"


def _raise(error):
    def call(*args):
        raise error
    return call


def test_snapshots_that_a_killed_ps_took_with_it_do_not_fail_the_job(tmp_path, monkeypatch, caplog):
    """A PS SIGKILLed after an evaluation: its snapshot is gone. The epoch's callbacks see the
    model as last pulled, and the round's snapshot is not dropped there; neither fails the job
    (both did, in clean-clone runs of the PS-kill test). Another error still does."""
    from elasticdl.master import controller as c

    job, _ = a_job(tmp_path, monkeypatch, "train")
    job._ps.pull_snapshot = _raise(_PSAway())
    job._ps.drop_snapshot = _raise(_PSAway())
    seen = []
    job.callbacks = SimpleNamespace(on_epoch_end=lambda epoch, logs: seen.append(epoch))
    job._model = SimpleNamespace(stop_training=False)
    monkeypatch.setattr(job, "_epoch_logs", lambda: {})
    with caplog.at_level("INFO"):
        assert job._carry_out(c.FireEpochEnd(0, metrics={}, snapshot=4)) == [c.EpochEndFired(0)]
        assert job._carry_out(c.DropSnapshot(4)) == []
    assert seen == [0]
    assert "epoch 1's snapshot is gone with a parameter server" in caplog.text
    assert "snapshot 4 not dropped on every PS (UNAVAILABLE)" in caplog.text
    job._ps.drop_snapshot = _raise(_PSAway(grpc.StatusCode.INVALID_ARGUMENT))
    assert job._carry_out(c.DropSnapshot(4, best_effort=True)) == []
    with pytest.raises(grpc.RpcError):
        job._carry_out(c.DropSnapshot(4))
