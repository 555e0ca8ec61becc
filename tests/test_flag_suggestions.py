"""Flags: no prefix matching, "did you mean" for an unknown flag (Keras's names too), the
subcommand's usage on an error, and the nearest name for a missing model-zoo function."""

from __future__ import annotations

import ast
import pathlib

import pytest
from zoo_helpers import restore_import_state

from elasticdl import cli
from elasticdl.cli.zoo import main as zoo_main
from elasticdl.config import FLAGS, ConfigError, JobConfig
from elasticdl.config.suggest import KERAS_ELSEWHERE, KERAS_NAMES, flag_hint
from elasticdl.model.spec import ModelSpecError, load_model_spec

PACKAGE = pathlib.Path(cli.__file__).parent.parent
_restore_import_state = restore_import_state("typo_zoo")


def command_line_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.config_from_args(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--num_worker", "3"],
    ["--num_workers", "2", "--num_worker", "3"],  # argparse took the prefix and overrode the 2
    ["--num_worker=3"],
    ["--minibatch", "8"],
])
def test_a_prefix_of_a_flag_is_an_error(capsys, argv):
    err = command_line_error(capsys, "train", *argv)
    assert f"unrecognized arguments: {argv[-2] if '=' not in argv[-1] else argv[-1]}" in err
    assert "did you mean --" in err


@pytest.mark.parametrize("typed, meant", [
    ("--batch_size", "--minibatch_size"),
    ("--epochs", "--num_epochs"),
    ("--validation_batch_size", "--minibatch_size"),
    ("--num_worker", "--num_workers"),
    ("--checkpoint_step", "--checkpoint_steps"),
])
def test_an_unknown_flag_gets_the_flag_meant_and_the_subcommands_usage(capsys, typed, meant):
    err = command_line_error(capsys, "train", typed, "64")
    assert err.startswith("usage: elasticdl train ")  # not `elasticdl [-h] COMMAND ...`
    assert f"elasticdl train: error: unrecognized arguments: {typed}" in err
    assert f"{typed}: did you mean {meant}?" in err


def test_a_keras_name_without_a_flag_says_where_it_goes(capsys):
    err = command_line_error(capsys, "train", "--steps_per_epoch", "10")
    assert "Keras's steps_per_epoch has no flag: an epoch is one pass over --training_data" in err


def test_a_flag_of_another_command_names_that_command(capsys):
    err = command_line_error(capsys, "evaluate", "--num_epochs", "3")
    assert "--num_epochs is a flag of `elasticdl train`, not of `elasticdl evaluate`" in err


def test_a_short_usage_is_shown_whole_and_a_typo_comes_before_a_missing_required_flag(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["scale", "--job_nam", "j", "--num_workers", "2"])
    err = capsys.readouterr().err
    assert err.startswith("usage: elasticdl scale [-h] --job_name JOB_NAME")
    assert "--job_nam: did you mean --job_name?" in err
    assert "required" not in err


def test_a_mistyped_command_gets_the_nearest_one(capsys):
    err = command_line_error(capsys, "trian", "--num_workers", "2")
    assert "invalid choice: 'trian'" in err and "did you mean 'train'?" in err
    with pytest.raises(SystemExit):
        zoo_main(["zoo", "biuld"])
    assert "did you mean 'build'?" in capsys.readouterr().err


def test_zoo_takes_no_prefix_either(capsys):
    with pytest.raises(SystemExit):
        zoo_main(["zoo", "init", "--model_zo", "z"])
    assert "--model_zo: did you mean --model_zoo?" in capsys.readouterr().err


def test_the_python_api_gets_the_same_hints():
    with pytest.raises(ConfigError) as info:
        JobConfig.from_flags(batch_size=64, num_worker=2)
    message = str(info.value)
    assert "batch_size: did you mean minibatch_size? (Keras's batch_size)" in message
    assert "num_worker: did you mean num_workers?" in message


def test_every_keras_alias_is_a_real_flag_and_every_keras_name_without_one_has_none():
    assert set(KERAS_NAMES.values()) <= set(FLAGS)
    assert not set(KERAS_ELSEWHERE) & set(FLAGS)
    assert flag_hint("no_such_thing_at_all", FLAGS) == ""


def _parser_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "ArgumentParser":
                yield node


def test_every_argument_parser_of_the_package_refuses_prefixes():
    """A parser added later must not bring prefix matching back (the CLI's own class,
    elasticdl/cli/argparser.py, sets it for itself and its subparsers)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for call in _parser_calls(ast.parse(path.read_text())):
            keywords = {k.arg: k.value for k in call.keywords}
            ok = isinstance(keywords.get("allow_abbrev"), ast.Constant) and keywords["allow_abbrev"].value is False
            found.append((str(path.relative_to(PACKAGE)), call.lineno, ok))
    assert len(found) >= 4  # the search finds the parsers
    assert [f for f in found if not f[2]] == []
    parser = cli.build_parser()
    subparsers = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    assert not parser.allow_abbrev and all(not p.allow_abbrev for p in subparsers.values())


def test_a_missing_model_zoo_function_gets_the_nearest_name(tmp_path):
    package = tmp_path / "typo_zoo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(
        "def custom_modle():\n    pass\n\n"
        "def loss_fn(labels, predictions):\n    pass\n"
    )
    with pytest.raises(ModelSpecError) as info:
        load_model_spec(str(tmp_path), "typo_zoo.model.custom_model")
    assert "missing `custom_model` (from --model_def)" in str(info.value)
    assert str(info.value).endswith("Did you mean `custom_modle`?")
    (package / "renamed.py").write_text(
        "def custom_model():\n    pass\n\n"
        "def loss_fn(labels, predictions):\n    pass\n"
    )
    with pytest.raises(ModelSpecError) as info:
        load_model_spec(str(tmp_path), "typo_zoo.renamed.custom_model")
    assert "missing `loss`" in str(info.value) and str(info.value).endswith("Did you mean `loss_fn`?")
