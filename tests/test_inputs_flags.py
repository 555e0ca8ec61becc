"""Every number and bool flag is checked by the rule of its type, wherever it enters a JobConfig.

The flags come from the sections' dataclasses (their type hints), so a flag added to a section
is covered here without a line of its own: a float must be finite (``--task_timeout nan`` once
was taken and never timed out), an int a whole number in its range, a bool True or False
(``elasticdl.train(use_async="no")`` once meant True).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from elasticdl import api, cli
from elasticdl.config import FLAGS, SECTIONS, ConfigError, JobConfig
from elasticdl.config.fields import INT32_MAX


def _flags_of_type(kind: type) -> list[str]:
    names = []
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        names += [f.name for f in dataclasses.fields(cls) if hints[f.name] is kind]
    return names


FLOATS, INTS, BOOLS = _flags_of_type(float), _flags_of_type(int), _flags_of_type(bool)
NUMBERS = FLOATS + INTS

NOT_A_FLOAT = [math.nan, math.inf, -math.inf, "1.5", True, None, [1.0]]
NOT_AN_INT = [2.5, 3.0, "3", True, math.nan, None, INT32_MAX + 1, 2**63]
NOT_A_BOOL = ["no", "yes", "false", 1, 0, None, 1.0]

CASES = ([(n, v) for n in FLOATS for v in NOT_A_FLOAT] + [(n, v) for n in INTS for v in NOT_AN_INT]
         + [(n, v) for n in BOOLS for v in NOT_A_BOOL])


def test_the_sections_have_flags_of_every_type():
    # The lists are derived; this guards the derivation, not a count of flags.
    assert "task_timeout" in FLOATS and "worker_pod_priority" in FLOATS
    assert "minibatch_size" in INTS and "use_async" in BOOLS


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_a_value_not_of_the_flags_type_is_refused_naming_the_flag(name, value):
    for build in (JobConfig.from_flags, api.make_config, JobConfig().replace):
        with pytest.raises(ConfigError) as info:
            build(**{name: value})
        assert f"--{name}" in str(info.value) and "Received" in str(info.value)


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_validate_refuses_it_in_a_section_built_by_hand(name, value):
    if FLAGS[name].parse is not None:
        pytest.skip("a structured flag's section holds its parsed value: it only comes from text")
    config = JobConfig()
    setattr(getattr(config, FLAGS[name].section), name, value)
    with pytest.raises(ConfigError, match=f"--{name} "):
        config.validate("train", check_paths=False)


@pytest.mark.parametrize("name", NUMBERS)
def test_every_number_flag_refuses_values_below_its_range(name):
    flag = FLAGS[name]
    low = flag.bounds.low
    if low is None:
        pytest.skip(f"--{name} takes any finite number (its help says what a negative one means)")
    below = low if flag.bounds.low_open else (low - 1 if flag.kind is int or flag.held is int else low - 0.5)
    with pytest.raises(ConfigError, match=f"--{name}"):
        JobConfig.from_flags(**{name: below})


@pytest.mark.parametrize("name", [n for n in NUMBERS if FLAGS[n].parse is None])
def test_every_number_flags_default_is_in_its_range(name):
    assert FLAGS[name].bounds.holds(FLAGS[name].default, FLAGS[name].kind)


@pytest.mark.parametrize("name", [n for n in FLOATS if FLAGS[n].parse is None])
@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_the_command_line_refuses_a_float_that_is_not_finite(name, text):
    command = next(c for c in ("train", "evaluate", "predict") if c in FLAGS[name].commands)
    with pytest.raises(ConfigError, match=f"--{name} "):
        cli.config_from_args([command, f"--{name}={text}"])


def test_the_command_line_says_so_in_one_line_with_exit_2(capsys):
    assert cli.main(["train", "--task_timeout", "nan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl train: error: --task_timeout must be above 0 (a finite number)")
    assert "Received: task_timeout=nan" in err and err.count("\n") == 1


def test_the_python_api_refuses_a_string_for_a_bool_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--use_async must be true or false"):
        api.train(model_zoo="zoo", model_def="a.b.c", training_data="x", use_async="no")
    assert not (tmp_path / "runs").exists()


def test_ints_given_for_a_float_are_taken_as_floats_and_bools_as_they_are():
    config = JobConfig.from_flags(task_timeout=5, use_async=False, num_workers=2)
    assert config.elasticity.task_timeout == 5.0 and isinstance(config.elasticity.task_timeout, float)
    assert config.consistency.use_async is False and config.elasticity.num_workers == 2


def test_a_json_config_with_a_value_of_the_wrong_type_is_refused():
    text = JobConfig().to_json().replace('"task_timeout": 600.0', '"task_timeout": NaN')
    assert "NaN" in text
    with pytest.raises(ConfigError, match="--task_timeout"):
        JobConfig.from_json(text)
