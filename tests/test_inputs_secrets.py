"""Secrets are never written where another user could read them: the --envs values (every
one counts as a secret) and the job's token. runs/<job>/job_config.json holds the values, for
the local roles to read, and was written 0644; a whole local job is then searched for the
value in every file it wrote (runs/<job>/, the checkpoints, the SavedModel).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from elasticdl.config import JobConfig
from elasticdl.master.job import write_job_config
from elasticdl.rpc import auth

SECRET = "s3cr3t-Val-0f-the-envs"
REPO = Path(__file__).resolve().parent.parent


def _readable_by_others(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_the_job_config_is_owner_only_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d", job_name="secrets",
                                  envs=f"API_KEY={SECRET},OTHER=x")
    old = os.umask(0o022)  # the usual umask: a plain open() makes 0644
    try:
        write_job_config(config)
        path = Path(write_job_config(config)).resolve()  # written again (prewarm, then the job)
    finally:
        os.umask(old)
    assert path == tmp_path.resolve() / "runs" / "secrets" / "job_config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert JobConfig.from_json(path.read_text()).kubernetes.envs == {"API_KEY": SECRET, "OTHER": "x"}


def test_a_local_job_leaves_no_secret_readable_by_others(tmp_path):
    zoo = REPO / "model_zoo"
    data = tmp_path / "digits"
    subprocess.run([sys.executable, str(zoo / "digits" / "prepare_data.py"), "--output", str(data)],
                   check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != auth.TOKEN_FILE_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", str(zoo),
         "--model_def", "digits.digits_functional.custom_model", "--training_data", str(data / "train"),
         "--validation_data", str(data / "test"), "--minibatch_size", "128", "--num_epochs", "1",
         "--num_workers", "1", "--num_ps", "1", "--job_name", "secretjob", "--envs", f"API_KEY={SECRET}",
         "--checkpoint_dir", "ckpt", "--checkpoint_steps", "5", "--output", "model"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout[result.stdout.index("{"):])["status"] == "succeeded"
    run_dir = tmp_path / "runs" / "secretjob"
    token = (run_dir / "token").read_text().strip()
    written = [run_dir, tmp_path / "ckpt", tmp_path / "model"]
    holding = {p for root in written for needle in (SECRET, token) for p in _files_holding(root, needle.encode())}
    assert run_dir / "job_config.json" in holding and run_dir / "token" in holding  # the search finds them
    assert [p for p in holding if _readable_by_others(p)] == []
