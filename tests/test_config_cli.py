"""JobConfig, its validation, and the `elasticdl` command line built from it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticdl import api, cli
from elasticdl.config import FLAGS, ConfigError, JobConfig, parse_kv_params


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "elasticdl", *args], capture_output=True, text=True, env=env, timeout=60
    )


# ---------------------------------------------------------------- parsing flags


def test_every_flag_type_parses():
    command, cfg = cli.config_from_args([
        "train",
        "--model_zoo", "zoo",
        "--model_def", "pkg.mod.fn",
        "--model_params", "a=1;b='x'",
        "--training_data", "data/train",
        "--minibatch_size", "32",
        "--task_timeout", "2.5",
        "--use_async",
        "--num_ps_pods", "3",
        "--log_level", "DEBUG",
        "--job_name", "my-job",
    ])
    assert command == "train"
    assert cfg.training.model_zoo == "zoo" and cfg.training.model_def == "pkg.mod.fn"
    assert cfg.training.model_params == {"a": 1, "b": "x"}
    assert cfg.data.training_data == "data/train"
    assert cfg.training.minibatch_size == 32 and isinstance(cfg.training.minibatch_size, int)
    assert cfg.elasticity.task_timeout == 2.5 and isinstance(cfg.elasticity.task_timeout, float)
    assert cfg.consistency.use_async is True
    assert cfg.elasticity.num_ps == 3  # --num_ps_pods is an alias
    assert cfg.job.log_level == "DEBUG" and cfg.job.job_name == "my-job"


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], False),
        (["--use_async"], True),
        (["--use_async", "true"], True),
        (["--use_async", "false"], False),
        (["--use_async=False"], False),
        (["--use_async", "1"], True),
        (["--use_async", "no"], False),
        (["--use_async", "On"], True),
    ],
)
def test_bool_flag_forms(args, expected):
    _, cfg = cli.config_from_args(["train", *args])
    assert cfg.consistency.use_async is expected


def test_bool_flag_followed_by_another_flag():
    _, cfg = cli.config_from_args(["train", "--use_async", "--num_ps", "2"])
    assert cfg.consistency.use_async is True and cfg.elasticity.num_ps == 2


def test_num_ps_and_alias_are_the_same_flag():
    assert cli.config_from_args(["train", "--num_ps", "4"])[1].elasticity.num_ps == 4
    assert cli.config_from_args(["train", "--num_ps_pods", "4"])[1].elasticity.num_ps == 4


def test_defaults_equal_jobconfig_defaults():
    _, cfg = cli.config_from_args(["train"])
    defaults = JobConfig()
    for name in FLAGS:
        if name in ("job_name", "prediction_outputs"):
            continue  # derived defaults, checked below
        assert cfg.flag_value(name) == defaults.flag_value(name), name
        assert type(cfg.flag_value(name)) is type(defaults.flag_value(name)), name
    assert cfg.job.job_name.startswith("elasticdl-job-")  # filled by with_defaults()
    assert cfg.outputs.prediction_outputs == f"runs/{cfg.job.job_name}/predictions"


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--bogus_flag", "1"], "unrecognized arguments: --bogus_flag"),
        (["train", "--use_async", "maybe"], "expected true or false"),
        (["train", "--minibatch_size", "ten"], "invalid int value: 'ten'"),
        (["train", "--task_timeout", "soon"], "invalid float value: 'soon'"),
        (["fly"], "invalid choice: 'fly'"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_command_lines_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.config_from_args(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: elasticdl")


def test_help_lists_every_flag_with_its_default():
    top = run_cli("--help")
    assert top.returncode == 0
    assert "train" in top.stdout and "Train a model-zoo model" in top.stdout

    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # undo argparse's line wrapping
    for name, f in FLAGS.items():
        if "train" not in f.commands:
            continue
        assert f"--{name}" in text, name
        help_text = " ".join(f.help.split())
        assert f"{help_text} (default: {f.default!r})" in text, name
    assert "--num_ps_pods" in text


def test_unknown_flag_exits_2_from_the_command():
    result = run_cli("train", "--no_such_flag")
    assert result.returncode == 2
    # The subcommand reports it, with its own usage (elasticdl/cli/argparser.py).
    assert "elasticdl train: error: unrecognized arguments: --no_such_flag" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- validation


@pytest.fixture
def valid(tmp_path) -> JobConfig:
    cfg = JobConfig.from_flags(model_zoo=str(tmp_path), model_def="pkg.mod.custom_model", training_data="data/train")
    cfg.validate("train")  # the base is valid: each case below breaks exactly one thing
    return cfg


INVALID = [
    ({"model_zoo": ""}, "--model_zoo is required"),
    ({"model_zoo": "/no/such/zoo"}, "--model_zoo '/no/such/zoo' is not a directory"),
    ({"model_def": "custom_model"}, "--model_def must be pkg.module.name"),
    ({"model_def": ""}, "--model_def"),
    ({"training_data": ""}, "--training_data is required"),
    ({"task_timeout": 0.0}, "--task_timeout must be above 0"),
    ({"backend": "yarn"}, "--backend must be one of local, kubernetes"),
    ({"backend": "kubernetes"}, "--backend kubernetes needs --image_name"),
    ({"log_level": "LOUD"}, "--log_level must be one of"),
    ({"use_async": True, "grads_to_wait": 2}, ("--grads_to_wait", "sync training", "--use_async")),
    ({"checkpoint_steps": 5}, "--checkpoint_steps needs --checkpoint_dir"),
    ({"checkpoint_dir_for_init": "/no/such/ckpt"}, "--checkpoint_dir_for_init '/no/such/ckpt' does not exist"),
    ({"model_params": "hidden_units"}, "--model_params must look like"),
    ({"data_reader_params": "=1"}, "--data_reader_params must look like"),
    *[({name: 0}, f"--{name} must be at least 1")
      for name in ("minibatch_size", "num_epochs", "num_workers", "num_ps", "num_minibatches_per_task")],
    *[({name: -1}, f"--{name} must be 0 or more")
      for name in ("records_per_task", "checkpoint_steps", "keep_checkpoint_max",
                   "max_task_retries", "num_threads_per_process", "grads_to_wait")],
]


@pytest.mark.parametrize("changes, message", INVALID, ids=[str(c) for c, _ in INVALID])
def test_validate_names_the_flag(valid, changes, message):
    with pytest.raises(ConfigError) as info:
        valid.replace(**changes).validate("train")
    for part in (message,) if isinstance(message, str) else message:
        assert part in str(info.value)


def test_validate_per_command(valid):
    with pytest.raises(ConfigError, match="--validation_data is required for `elasticdl evaluate`"):
        valid.validate("evaluate")
    with pytest.raises(ConfigError, match="--checkpoint_dir_for_init is required for `elasticdl evaluate`"):
        valid.replace(validation_data="data/test").validate("evaluate")
    with pytest.raises(ConfigError, match="--prediction_data is required for `elasticdl predict`"):
        valid.validate("predict")
    # evaluate reads --validation_data and does not need --training_data.
    valid.replace(
        training_data="", validation_data="data/test", checkpoint_dir_for_init=valid.training.model_zoo
    ).validate("evaluate")
    with pytest.raises(ConfigError, match="--evaluation_steps needs --validation_data"):
        valid.replace(evaluation_steps=10).validate("train")
    with pytest.raises(ConfigError, match="Unknown command 'serve'"):
        valid.validate("serve")


def test_validate_accepts_edge_values(valid, tmp_path):
    valid.replace(
        records_per_task=0, keep_checkpoint_max=0, max_task_retries=0, use_async=True, grads_to_wait=1, log_level="debug", checkpoint_steps=3, checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_dir_for_init=str(tmp_path),
    ).validate("train")


# ---------------------------------------------------------------- key=value params


def test_parse_kv_params():
    assert parse_kv_params("a=1;b=2.5;c='x';d=relu", "--model_params") == {
        "a": 1, "b": 2.5, "c": "x", "d": "relu",
    }
    assert parse_kv_params(" a = [1, 2] ; flag=True ;; e=None;", "--x") == {
        "a": [1, 2], "flag": True, "e": None,
    }
    assert parse_kv_params("", "--x") == {}
    assert parse_kv_params("path=/data/x=y", "--x") == {"path": "/data/x=y"}
    # Not a literal (an unhashable key): kept as the string, not a crash.
    assert parse_kv_params("a={[]: 1}", "--x") == {"a": "{[]: 1}"}


@pytest.mark.parametrize("text", ["a", "a=1;b", "=1", "1a=2", "a-b=3", "a b=1"])
def test_parse_kv_params_malformed(text):
    with pytest.raises(ConfigError) as info:
        parse_kv_params(text, "--model_params")
    message = str(info.value)
    assert message.startswith("--model_params must look like")
    assert repr(text) in message


# ---------------------------------------------------------------- JSON, API


def test_json_round_trip():
    cfg = JobConfig.from_flags(
        model_zoo="zoo", model_def="a.b.c", num_ps=3, use_async=True, task_timeout=1.5,
        model_params="a=1;b='x'", job_name="j",
    )
    back = JobConfig.from_json(cfg.to_json())
    assert back == cfg
    assert isinstance(back.elasticity.task_timeout, float) and back.consistency.use_async is True
    assert JobConfig.from_json(JobConfig().to_json()) == JobConfig()


def test_with_defaults_names_the_job():
    cfg = JobConfig.from_flags(model_def="digits.digits_functional.custom_model").with_defaults()
    assert cfg.job.job_name.startswith("elasticdl-digits-")
    assert cfg.job.effective_log_dir == os.path.join("runs", cfg.job.job_name, "logs")
    named = JobConfig.from_flags(job_name="mine").with_defaults()
    assert named.job.job_name == "mine"
    assert JobConfig.from_flags(minibatch_size=16, num_minibatches_per_task=4).effective_records_per_task == 64
    assert JobConfig.from_flags(records_per_task=10).effective_records_per_task == 10


def test_make_config():
    cfg = api.make_config(model_zoo="zoo", num_ps=2, use_async=True)
    assert (cfg.training.model_zoo, cfg.elasticity.num_ps, cfg.consistency.use_async) == ("zoo", 2, True)
    assert cfg.job.job_name


def test_make_config_rejects_unknown_options():
    with pytest.raises(ConfigError) as info:
        api.make_config(model_zoo="zoo", num_pss=2, batch_size=3)
    message = str(info.value)
    assert "batch_size, num_pss" in message
    assert "elasticdl train --help" in message
