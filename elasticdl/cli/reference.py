"""Render the command-line reference (docs/cli.md) from the real argument parser.

    python -m elasticdl.cli.reference > docs/cli.md

The tables come from ``elasticdl.cli.build_parser()``, whose flags come from the fields
of JobConfig's sections (one table per section, under its title); tests/test_docs.py fails
when docs/cli.md is stale.
The output depends only on the code (no terminal width, no time, no paths), so the same
code always renders the same file.
"""

from __future__ import annotations

import argparse
import math

from elasticdl.config import FLAGS
from elasticdl.config.fields import INT32_MAX

REGENERATE_COMMAND = "python -m elasticdl.cli.reference > docs/cli.md"


def _range_rule(text: str, low: float, low_open: bool, value: float) -> tuple[str, tuple[dict, ...]]:
    """The rule of the number flags whose fields declare this lower bound, each with ``value``
    to break it: a flag added with a range joins its rule here and in docs/cli.md."""
    names = [name for name, f in FLAGS.items()
             if f.kind in (int, float) and (f.bounds.low, f.bounds.low_open) == (low, low_open)]
    listed = ", ".join(f"`--{name}`" for name in names[:-1]) + (" or " if len(names) > 1 else "") + f"`--{names[-1]}`"
    return f"{listed} is {text}", tuple({name: value} for name in names)


# The flag rules of JobConfig.validate(), as docs/cli.md states them. Each comes with flag
# values that break it; tests/test_docs.py checks that every one of them is refused, so a
# rule that changes in config.py without this list fails the tests.
VALIDATION_RULES: tuple[tuple[str, tuple[dict, ...]], ...] = (
    ("`--model_zoo` is missing or not a directory", ({"model_zoo": ""}, {"model_zoo": "/nonexistent/zoo"})),
    ("`--model_def` is not `pkg.module.name`", ({"model_def": ""}, {"model_def": "custom_model"})),
    ("`--training_data` is missing (`train`)", ({"training_data": ""},)),
    (
        "a `bool` flag (e.g. `--use_async`, `--overlap_communication`) is not true or false (the Python API "
        "takes `True` or `False`, not `\"no\"` or 1), an `int` flag (e.g. `--minibatch_size`, `--num_workers`) "
        "not a whole number, a `float` flag (e.g. `--task_timeout`, `--evaluation_throttle_secs`) not a finite "
        "number (`nan` and `inf` are refused)",
        ({"use_async": "no"}, {"overlap_communication": 1}, {"minibatch_size": 2.5}, {"num_workers": True},
         {"task_timeout": math.nan}, {"evaluation_throttle_secs": math.inf}),
    ),
    _range_rule("below 1", 1, False, 0),
    (
        "`--num_workers` is more than `--max_workers` (which `elasticdl scale` cannot pass either)",
        ({"num_workers": 65}, {"num_workers": 3, "max_workers": 2}),
    ),
    _range_rule("negative", 0, False, -1),
    _range_rule("not above 0", 0, True, 0),
    (
        f"an `int` flag (e.g. `--max_bad_records`, `--checkpoint_steps`) is above {INT32_MAX}",
        ({"max_bad_records": INT32_MAX + 1}, {"checkpoint_steps": 2**63}),
    ),
    (
        "`--backend` is not `local` or `kubernetes`; with `kubernetes`: `--image_name` is missing, "
        "`--job_name` cannot name pods, or `--worker_resource_request` (or another resource, `--volume`, "
        "`--envs`, `--image_pull_policy`) does not parse",
        ({"backend": "kubernetes"}, {"backend": "yarn"},
         {"backend": "kubernetes", "image_name": "i", "worker_resource_request": "cpu=one"},
         {"backend": "kubernetes", "image_name": "i", "volume": "mount_path=/d"}),
    ),
    ("`--log_level` is not one of DEBUG, INFO, WARNING, ERROR (any case)", ({"log_level": "TRACE"},)),
    ("`--keras_version` is not auto, 2 or 3", ({"keras_version": "4"},)),
    ("`--wire_dtype` is not float32, bfloat16 or float16", ({"wire_dtype": "int8"}, {"wire_dtype": "bf16"})),
    ("`--tensor_transport` is not grpc or tcp", ({"tensor_transport": "zmq"},)),
    (
        "`--use_async` is combined with `--grads_to_wait` above 1 or with `--sync_version_tolerance`",
        ({"use_async": True, "grads_to_wait": 2}, {"use_async": True, "sync_version_tolerance": 1}),
    ),
    (
        "`--staleness_bound` or `--overlap_communication`, or `--get_model_steps` or `--push_steps` other "
        "than 1, is given without `--use_async`",
        ({"staleness_bound": 2}, {"get_model_steps": 2}, {"push_steps": 4}, {"overlap_communication": True}),
    ),
    (
        "`--overlap_communication` is combined with `--push_steps` above 1",
        ({"use_async": True, "overlap_communication": True, "push_steps": 4},),
    ),
    (
        "`--lr_staleness_modulation` is given in sync mode without `--sync_version_tolerance` "
        "(every applied gradient would have staleness 0)",
        ({"lr_staleness_modulation": True},),
    ),
    ("`--checkpoint_steps` is given without `--checkpoint_dir`", ({"checkpoint_steps": 10},)),
    ("`--checkpoint_dir_for_init` does not exist", ({"checkpoint_dir_for_init": "/nonexistent/ckpt"},)),
    (
        "`--model_params` or `--data_reader_params` is not like `a=1;b=2.5;c='x'`",
        ({"model_params": "hidden_units"}, {"data_reader_params": "1=2"}),
    ),
)



def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of every subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub_parser in action.choices.items():
                found.append((name, helps.get(name, ""), sub_parser))
    return found


def _type_name(action: argparse.Action) -> str:
    kind = action.type
    if kind is None:
        return "string"
    if kind is str:
        return "string"
    if kind is int:
        return "int"
    if kind is float:
        return "float"
    from elasticdl.cli.parser import parse_bool

    if kind is parse_bool:
        return "bool"
    return getattr(kind, "__name__", str(kind))


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == "":
        return "*(empty)*"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _strip_default(action: argparse.Action) -> str:
    """The help text without the " (default: ...)" that parser.py appends; the table has a column."""
    help_text = action.help or ""
    suffix = f" (default: {action.default!r})"
    return help_text[: -len(suffix)] if help_text.endswith(suffix) else help_text


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no raw pipes; <x> is not read as HTML)."""
    text = " ".join(text.split())
    for char in "|<>":
        text = text.replace(char, "\\" + char)
    return text


def _flag_cell(action: argparse.Action) -> str:
    long_names = [s for s in action.option_strings if s.startswith("--")]
    others = [s for s in action.option_strings if not s.startswith("--")]
    names = [f"`{name}`" for name in long_names + others]
    if len(names) == 1:
        return names[0]
    return f"{names[0]} (alias: {', '.join(names[1:])})"


def _flag_table(actions: list[argparse.Action]) -> list[str]:
    lines = ["| Flag | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for action in actions:
        help_text = _strip_default(action)
        lines.append(
            f"| {_flag_cell(action)} | {_type_name(action)} | {_default(action)} | {_cell(help_text)} |"
        )
    return lines


def _flag_tables(parser: argparse.ArgumentParser) -> list[str]:
    """One table per argument group; a JobConfig section's group under its title (### heading)."""
    from elasticdl.config import SECTIONS

    titles = {cls.TITLE for cls in SECTIONS.values()}
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if group.title in titles:
            out += [f"### {group.title}", ""]
            if group.description:
                out += [_cell(group.description), ""]
        out += [*_flag_table(actions), ""]
    return out


def render() -> str:
    """docs/cli.md as a string."""
    from elasticdl.cli.parser import build_parser
    from elasticdl.config import COMMANDS

    parser = build_parser()
    subcommands = _subcommands(parser)
    names = [name for name, _, _ in subcommands]
    planned = [command for command in COMMANDS if command not in names]

    out = [
        "<!-- Generated from elasticdl/cli/parser.py and elasticdl/config/sections.py; do not edit by hand. -->",
        "",
        "# Command-line reference",
        "",
        f"Regenerate this file with `{REGENERATE_COMMAND}`",
        "(tests/test_docs.py fails when it is out of date).",
        "",
        f"`{parser.prog}`: {parser.description}",
        "",
        "| Command | What it does |",
        "| --- | --- |",
    ]
    for name, help_text, _ in subcommands:
        out.append(f"| [`{parser.prog} {name}`](#{parser.prog}-{name}) | {_cell(help_text)} |")
    out.append("")
    if planned:
        out += [
            f"Not in this version yet: {', '.join(f'`{parser.prog} {c}`' for c in planned)}.",
            "",
        ]
    out += [
        "A flag takes its value as the next argument or after `=` (`--num_workers 2`,",
        "`--num_workers=2`). A `bool` flag alone means true (`--use_async`); it also takes",
        "`true`/`false`, `yes`/`no`, `on`/`off` or `1`/`0`.",
        f"`{parser.prog} COMMAND --help` prints the same list. The Python API takes the same",
        "names as keyword arguments, without the dashes: `elasticdl.train(num_workers=2, ...)`;",
        "aliases work on the command line only.",
        "The flags of a command come in the sections of `JobConfig` (elasticdl/config/sections.py),",
        "one table per section; the names stay flat, a flag's section is not part of its name.",
        "",
        "A flag is its whole name: a prefix is an error, not the flag it starts (`--num_work 3` is",
        "refused; argparse would have taken it for `--num_workers`). A flag the command does not take",
        "is refused (exit code 2) with the command's usage and a hint: Keras's name for a setting",
        "gets the flag that does its job (`--batch_size` -> `--minibatch_size`, `--epochs` ->",
        "`--num_epochs`) or where the setting goes instead (`--steps_per_epoch`; see",
        "[model_zoo.md](model_zoo.md#from-modelfit)), a flag of another command names that command,",
        "and a typo gets the nearest flag (a mistyped command, the nearest command):",
        "",
        "```",
        "usage: elasticdl train [FLAGS]  (`elasticdl train --help` lists them)",
        "elasticdl train: error: unrecognized arguments: --batch_size",
        "--batch_size: did you mean --minibatch_size? (Keras's batch_size)",
        "```",
        "",
    ]
    for name, help_text, sub_parser in subcommands:
        out += [
            f"## {parser.prog} {name}",
            "",
            _cell(help_text),
            "",
            "```",
            f"{parser.prog} {name} [FLAGS]",
            "```",
            "",
            *_flag_tables(sub_parser),
        ]
    out += [
        "## Checks before anything starts",
        "",
        "`JobConfig.validate()` (elasticdl/config/__init__.py) stops the command with exit code 2 and a",
        "message naming the flag when:",
        "",
        *(f"- {text}{'.' if i == len(VALIDATION_RULES) - 1 else ';'}"
          for i, (text, _) in enumerate(VALIDATION_RULES)),
        "",
        "The model-zoo checks that follow are described in [model_zoo.md](model_zoo.md#submit-time-checks).",
    ]
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    import sys

    sys.stdout.write(render())


if __name__ == "__main__":
    main()
