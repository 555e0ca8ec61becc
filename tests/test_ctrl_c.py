"""Ctrl-C: acknowledged at once, the roles stopped within one deadline, and the checkpoint and
the command to continue from named (the end-to-end timing is in test_e2e_local.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess

import pytest

from elasticdl import cli
from elasticdl.cli import interrupt
from elasticdl.cli.interrupt import CtrlC, continuation
from elasticdl.config import JobConfig
from elasticdl.launch import local
from elasticdl.master.continuation import continue_command, last_complete_checkpoint
from elasticdl.model.checkpoint import shard_file_name


def write_cut(checkpoint_dir, version: int, shards: list[int], num_ps: int) -> str:
    directory = checkpoint_dir / f"version-{version}"
    directory.mkdir(parents=True)
    for ps_id in shards:
        (directory / shard_file_name(ps_id, num_ps, 1)).write_bytes(b"")
    return str(directory)


def test_the_last_complete_checkpoint_is_the_newest_with_every_shard(tmp_path):
    assert last_complete_checkpoint("") == ""
    assert last_complete_checkpoint(str(tmp_path / "none")) == ""
    write_cut(tmp_path, 2300, [0, 1], 2)
    complete = write_cut(tmp_path, 2400, [0, 1], 2)
    write_cut(tmp_path, 2450, [1], 2)  # being written when Ctrl-C came
    assert last_complete_checkpoint(str(tmp_path)) == complete


def test_the_continue_command_repeats_the_jobs_flags_from_the_checkpoint_for_the_epochs_left(tmp_path):
    config = JobConfig.from_flags(
        model_zoo="zoo", model_def="m.mod.custom_model", training_data="data/train", num_epochs=10,
        num_workers=2, use_async=True, model_params="units=3;name='a b'", checkpoint_dir="ck",
        job_name="my-job",
    ).with_defaults()
    command = continue_command(config, "ck/version-2400", epochs_done=4)
    words = shlex.split(command)
    assert words[:2] == ["elasticdl", "train"] and "--job_name" not in words  # a new job
    _, continued = cli.config_from_args(words[1:])
    assert continued.checkpoints.checkpoint_dir_for_init == "ck/version-2400"
    assert continued.training.num_epochs == 6
    for name in ("model_zoo", "model_def", "training_data", "num_workers", "use_async", "model_params",
                 "checkpoint_dir"):
        assert continued.flag_value(name) == config.flag_value(name), name
    assert continue_command(config, "", epochs_done=4) == ""
    assert continue_command(config, "ck/version-2400", epochs_done=10) == ""


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler, as a command started from a terminal has it: a suite run in
    the background (or under nohup) starts with SIGINT ignored, which CtrlC leaves alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_command_started_with_sigint_ignored_keeps_it_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with CtrlC("elasticdl train"):
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_the_first_ctrl_c_says_so_at_once_naming_the_checkpoint(tmp_path, capsys):
    checkpoint = write_cut(tmp_path, 2400, [0], 1)
    with pytest.raises(KeyboardInterrupt), CtrlC("elasticdl train", str(tmp_path)) as ctrl_c:
        signal.raise_signal(signal.SIGINT)
    err = capsys.readouterr().err
    assert err == (f"\nelasticdl train: stopping: finishing the report and stopping every process "
                   f"(Ctrl-C again: at once); the last complete checkpoint is {checkpoint}\n")
    assert ctrl_c.pressed_at is not None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_second_ctrl_c_ends_the_command_at_once(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(interrupt.os, "_exit", exits.append)
    with pytest.raises(KeyboardInterrupt), CtrlC("elasticdl train") as ctrl_c:
        signal.raise_signal(signal.SIGINT)
    ctrl_c._handle(signal.SIGINT, None)  # the second press, while the job stops
    assert exits == [130]
    assert "stopping at once" in capsys.readouterr().err


def test_the_last_lines_come_from_this_runs_report_only(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"status": "interrupted", "checkpoint": "ck/version-2400",
                                  "continue_command": "elasticdl train --num_epochs 6"}))
    written = os.path.getmtime(report)
    assert continuation(str(report), written) == (
        "the last complete checkpoint is ck/version-2400; to continue from it:\n  elasticdl train --num_epochs 6")
    assert continuation(str(report), written + 1) == ""  # an earlier run's report
    assert continuation(str(tmp_path / "missing.json"), 0) == ""
    report.write_text(json.dumps({"status": "interrupted", "checkpoint": ""}))
    assert continuation(str(report), 0) == ""


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StuckProcess:
    """A child that ignores SIGTERM: each wait uses up its timeout on the clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.waited, self.killed = clock, [], False

    def poll(self):
        return -9 if self.killed else None

    def send_signal(self, sig) -> None:
        pass

    def wait(self, timeout=None):
        if self.killed:
            return -9
        self.waited.append(timeout)
        self.clock.now += timeout
        raise subprocess.TimeoutExpired("stuck", timeout)

    def kill(self) -> None:
        self.killed = True


def test_stopping_several_stuck_children_takes_one_timeout_not_one_each(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(local.time, "monotonic", clock)
    children = [StuckProcess(clock) for _ in range(3)]
    local._terminate(children, 0.4)
    assert all(c.killed for c in children)
    assert clock.now == pytest.approx(0.4)  # was 1.2: 0.4 for each in turn


def test_a_kubernetes_client_keeps_pythons_handler():
    """Its Ctrl-C stops following the master's log, not the job (launch/kubernetes/submit.py)."""
    with CtrlC("elasticdl train", enabled=False):
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
