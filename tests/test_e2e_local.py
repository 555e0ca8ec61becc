"""End to end: `elasticdl train` on digits with real processes over real gRPC."""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    subprocess.run(
        [sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"), "--output", str(out)],
        check=True, capture_output=True,
    )
    return out


def elasticdl(args: list[str], cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elasticdl", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def train_args(digits, model_def: str, **flags) -> list[str]:
    args = [
        "train", "--model_zoo", MODEL_ZOO, "--model_def", model_def,
        "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
        "--minibatch_size", "32", "--num_epochs", "3",
    ]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


def report_of(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def load_checkpoint_params(version_dir: str) -> dict[str, np.ndarray]:
    params = {}
    for path in sorted(glob.glob(os.path.join(version_dir, "ps-*.npz"))):
        with np.load(path) as data:
            for key in data.files:
                if key.startswith("param:"):
                    assert key[6:] not in params, f"{key} is held by two parameter servers"
                    params[key[6:]] = data[key]
    return params


def test_two_workers_one_ps_reach_accuracy_and_export(digits, tmp_path):
    result = elasticdl(
        # Five epochs: a version averages two gradients, or one while the other worker is
        # between tasks, so three epochs made 93 to 115 versions and ended at 0.84 to 0.96
        # accuracy (2 of 12 runs below 0.90); five ended at 0.955 or more in 8 of 8.
        train_args(digits, "digits.digits_functional.custom_model", num_workers=2, num_ps=1, num_epochs=5,
                   grads_to_wait=2, checkpoint_dir=tmp_path / "ckpt", output=tmp_path / "model",
                   job_name="e2e"),
        cwd=tmp_path,
    )
    report = report_of(result)
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["records_trained"] == 5 * 1437
    assert report["dropped_tasks"] == 0
    assert report["consistency"] == "sync SGD, grads_to_wait=2"
    assert report["staleness"]["staleness_histogram"].keys() == {"0"}  # strict sync
    assert os.path.isfile(tmp_path / "runs" / "e2e" / "logs" / "worker-1.log")

    # The SavedModel loads without ElasticDL and predicts what the trained parameters predict.
    import keras
    import tensorflow as tf

    from elasticdl.model.spec import load_model_spec

    loaded = tf.saved_model.load(report["saved_model"])
    serving = loaded.signatures["serving_default"]
    spec = load_model_spec(MODEL_ZOO, "digits.digits_functional.custom_model")
    model = spec.build_model({})
    params = load_checkpoint_params(report["checkpoint"])
    assert set(params) == {v.path for v in model.trainable_variables}
    for var in model.trainable_variables:
        var.assign(params[var.path])
    images = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    served = list(serving(tf.constant(images)).values())[0].numpy()
    np.testing.assert_allclose(served, model(images).numpy(), atol=1e-5)
    assert isinstance(model, keras.Model)

    cli = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "saved_model_cli"), "show", "--all",
         "--dir", report["saved_model"]],
        capture_output=True, text=True,
    )
    assert cli.returncode == 0 and "serving_default" in cli.stdout


def test_two_ps_hold_every_variable_once_and_restore_onto_one(digits, tmp_path):
    """A subclassed model with Adam on 2 PS; then its checkpoint restarts a job on 1 PS."""
    first = report_of(elasticdl(
        train_args(digits, "digits.digits_subclass.CustomModel", num_workers=2, num_ps=2,
                   num_epochs=3, checkpoint_dir=tmp_path / "ckpt", output=tmp_path / "model"),
        cwd=tmp_path,
    ))
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(first["checkpoint"], "*.npz")))
    assert files == ["ps-0-of-2.term-1.npz", "ps-1-of-2.term-1.npz"]  # the memory store's first term is 1
    assert first["exactly_once"]["holds"], first["exactly_once"]
    params = load_checkpoint_params(first["checkpoint"])  # asserts no variable is on both PS
    assert set(params) == {
        "digits_subclass/hidden/kernel", "digits_subclass/hidden/bias",
        "digits_subclass/logits/kernel", "digits_subclass/logits/bias",
    }
    with np.load(os.path.join(first["checkpoint"], "ps-0-of-2.term-1.npz")) as data:
        assert any(k.startswith("slot:velocity:") for k in data.files)  # Adam's slots are saved
    assert first["metrics"]["accuracy"] >= 0.90

    second = report_of(elasticdl(
        train_args(digits, "digits.digits_subclass.CustomModel", num_workers=1, num_ps=1,
                   num_epochs=1, checkpoint_dir_for_init=tmp_path / "ckpt"),
        cwd=tmp_path,
    ))
    # It continued from the checkpoint's version instead of starting over.
    assert second["model_version"] > first["model_version"]
    assert second["metrics"]["accuracy"] >= 0.90


@pytest.mark.warm_spares
def test_bad_model_zoo_fails_before_the_job_starts_and_leaves_nothing_behind(digits, tmp_path):
    zoo = tmp_path / "zoo" / "broken"
    zoo.mkdir(parents=True)
    (zoo / "no_loss.py").write_text(
        "import keras\n"
        "def custom_model():\n    return keras.Sequential([keras.layers.Dense(1)])\n"
        "def optimizer(lr=0.1):\n    return keras.optimizers.SGD(lr)\n"
        "def dataset_fn(dataset, mode, metadata):\n    return dataset\n"
    )
    result = elasticdl(
        ["train", "--model_zoo", str(tmp_path / "zoo"), "--model_def", "broken.no_loss.custom_model",
         "--training_data", str(digits / "train")],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "no_loss.py: missing `loss`" in result.stderr
    assert "loss(labels, predictions)" in result.stderr
    assert not (tmp_path / "runs").exists()  # the warm spares started meanwhile wrote nothing there


def _children_of(pid: int) -> list[int]:
    """Processes started by the local backend of ``pid`` (they carry its pid in their env)."""
    marker = f"ELASTICDL_PARENT_PID={pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            continue
    return alive


def _start_long_job(digits, tmp_path, **flags) -> tuple[subprocess.Popen, list[int]]:
    # Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`) holds
    # SIGINT ignored, which a child inherits; a handled signal is reset to its default at exec.
    # (Not a preexec_fn: Python code between fork and exec crashes beside librdkafka's threads.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        job = subprocess.Popen(
            [sys.executable, "-m", "elasticdl", *train_args(digits, "digits.digits_functional.custom_model",
                                                            num_workers=2, num_ps=1, num_epochs=1000, **flags)],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    started: list = []
    while time.monotonic() < deadline and len(started) < 3:  # the backend writes <role>-<i>.pid
        time.sleep(0.5)
        assert job.poll() is None, job.stderr.read()
        started = [*tmp_path.glob("runs/*/logs/ps-0.pid"), *tmp_path.glob("runs/*/logs/worker-[01].pid")]
    children = _alive(_children_of(job.pid))
    # 1 PS and 2 workers, and the warm spares the backend keeps (elasticdl/launch/local.py).
    assert len(started) == 3 and len(children) >= 3, (started, children)
    return job, children


@pytest.mark.warm_spares
@pytest.mark.parametrize("how", ["ctrl-c", "kill-9"])
def test_no_orphan_processes(digits, tmp_path, how):
    job, children = _start_long_job(digits, tmp_path)
    if how == "ctrl-c":
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=60) == 130
        assert "interrupted" in job.stderr.read()
    else:
        job.kill()
        job.wait(timeout=10)
    deadline = time.monotonic() + 30
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(children) == []


@pytest.mark.warm_spares
def test_ctrl_c_is_acknowledged_at_once_and_everything_stops_within_2s(digits, tmp_path):
    """The user's view of Ctrl-C: "stopping: ..." within 0.5 s, the command gone within 2 s with
    every process it started, and its last lines (and the report) naming the last complete
    checkpoint and the command that continues from it."""
    checkpoints = tmp_path / "ck"
    job, children = _start_long_job(digits, tmp_path, checkpoint_dir=checkpoints, checkpoint_steps=20)
    while not list(checkpoints.glob("version-*/ps-0-of-1*.npz")):  # a complete cut of the 1 PS
        assert job.poll() is None, job.stderr.read()
        time.sleep(0.05)  # polls another process's files for its first cut: a wait, no race
    lines: list[tuple[float, str]] = []
    acknowledged = threading.Event()

    def read_stderr() -> None:
        for line in job.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if "stopping:" in line:
                acknowledged.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    pressed = time.monotonic()
    job.send_signal(signal.SIGINT)
    assert acknowledged.wait(timeout=30)
    assert job.wait(timeout=30) == 130
    exited = time.monotonic()
    alive = _alive(children)
    reader.join(timeout=10)
    said = {text: at - pressed for at, text in lines}
    stopping = next(text for text in said if "stopping:" in text)
    assert said[stopping] <= 0.5, lines
    assert exited - pressed <= 2.0, lines
    assert alive == []
    report = json.loads(next((tmp_path / "runs").glob("*/report.json")).read_text())
    assert report["status"] == "interrupted" and report["checkpoint"].startswith(str(checkpoints / "version-"))
    # At the press; the report's may be a newer cut, completed while the PS stopped.
    assert f"the last complete checkpoint is {checkpoints / 'version-'}" in stopping
    text = "\n".join(t for _, t in lines)
    assert f"the last complete checkpoint is {report['checkpoint']}; to continue from it:" in text
    assert f"  {report['continue_command']}" in text
    words = shlex.split(report["continue_command"])
    assert words[:2] == ["elasticdl", "train"]
    assert words[words.index("--checkpoint_dir_for_init") + 1] == report["checkpoint"]


@pytest.mark.parametrize(
    "flags",
    [{"use_async": "true"}, {"use_async": "true", "staleness_bound": 2}],
    ids=["async", "ssp-2"],
)
def test_async_and_ssp_converge(digits, tmp_path, flags):
    """Sync (grads_to_wait=1 and 2) is covered above and in test_consistency.py."""
    report = report_of(elasticdl(
        # A fourth epoch: stale gradients converge a little slower than sync ones.
        train_args(digits, "digits.digits_functional.custom_model", num_workers=2, num_ps=1, num_epochs=4, **flags),
        cwd=tmp_path,
    ))
    # Stale gradients' result varies with how the OS schedules the two workers: async 0.90-0.96
    # in 24 runs two at a time, 0.894 once under the whole suite's load; SSP with a bound of 2
    # 0.881 once under load. Untrained, the model is at 0.10.
    assert report["metrics"]["accuracy"] >= 0.85
    assert report["staleness"]["pushes_accepted"] == report["model_version"]
    assert report["staleness"]["pushes_rejected_stale"] == 0


def test_overlapped_exchanges_converge_and_train_every_record_once(digits, tmp_path):
    """--overlap_communication: each batch's push and the pull after it run while the next batch
    computes. The accuracy bar of async without overlap, and every record's gradient applied
    once: each task's last exchange is settled before the task is reported. Gradients are about
    2 versions staler than without overlap on 2 workers: with digits' SGD (momentum 0.9) that
    takes --lr_staleness_modulation (docs/consistency.md)."""
    report = report_of(elasticdl(
        train_args(digits, "digits.digits_functional.custom_model", num_workers=2, num_ps=1, num_epochs=4,
                   use_async="true", overlap_communication="true", lr_staleness_modulation="true"),
        cwd=tmp_path,
    ))
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["exactly_once"]["holds"], report["exactly_once"]
    staleness = report["staleness"]
    assert staleness["pushes_accepted"] == report["model_version"]
    # Each batch is computed on parameters that miss the update of the push in flight, and the
    # PS counts it: only a task's first batch (the last task's exchange was settled) may be fresh.
    assert staleness["mean_staleness"] >= 1.0
    assert "communication overlapped with compute" in report["consistency"]


def test_accumulated_pushes_converge_and_train_every_record_once(digits, tmp_path):
    """--push_steps 4 (local SGD): each worker pushes the mean of 4 batches' gradients. Tasks of 6
    batches end with a mean of 2, pushed before the task is reported: none is lost (exactly once)."""
    report = report_of(elasticdl(
        train_args(digits, "digits.digits_functional.custom_model", num_workers=2, num_ps=1, num_epochs=3,
                   use_async="true", push_steps=4, num_minibatches_per_task=6),
        cwd=tmp_path,
    ))
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["exactly_once"]["holds"], report["exactly_once"]
    staleness = report["staleness"]
    assert staleness["pushes_accepted"] == report["model_version"]
    # 6 batches of 32 per task: pushes of 4 and of 2 batches (a file's last task may be shorter).
    assert 32 * 2 < staleness["records_per_push"] <= 32 * 4
    assert "push every 4 steps" in report["consistency"]
