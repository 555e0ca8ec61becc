"""The ``elasticdl`` argument parser, built from JobConfig's sections.

Every flag, its default and its help live in one place (elasticdl/config/sections.py), so
the CLI, the Python API and the generated reference (docs/cli.md) cannot drift apart. Each
section is an argument group: ``elasticdl train --help`` lists the flags under its title.
"""

from __future__ import annotations

import argparse

from elasticdl.cli.argparser import ElasticDLParser
from elasticdl.config import FLAGS, SECTIONS, JobConfig

SUBCOMMANDS = {
    "train": "Train a model-zoo model with parameter servers and workers.",
    "evaluate": "Evaluate a checkpoint (--checkpoint_dir_for_init) over --validation_data.",
    "predict": "Predict with a checkpoint over --prediction_data, one output row per record.",
}


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false. Received: {text!r}")


def _add_config_flags(parser: argparse.ArgumentParser, command: str) -> None:
    for section, cls in SECTIONS.items():
        flags = [f for f in FLAGS.values() if f.section == section and command in f.commands]
        if not flags:
            continue
        group = parser.add_argument_group(cls.TITLE, (cls.__doc__ or "").strip())
        for f in flags:
            help_text = f"{f.help} (default: {f.default!r})"
            if f.kind is bool:
                group.add_argument(f.option, *f.aliases, dest=f.name, type=parse_bool, nargs="?", const=True,
                                   default=f.default, metavar="BOOL", help=help_text)
            else:
                group.add_argument(f.option, *f.aliases, dest=f.name, type=f.kind, default=f.default,
                                   metavar=f.name.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = ElasticDLParser(
        prog="elasticdl",
        description="Elastic parameter-server training for Keras models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command, help_text in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(command, help=help_text, description=help_text)
        _add_config_flags(sub_parser, command)
    scale_help = "Change the number of workers of a running training job."
    scale = sub.add_parser("scale", help=scale_help, description=scale_help)
    scale.add_argument("--job_name", required=True, metavar="JOB_NAME",
                       help="The job to scale (its master's address is in runs/<job_name>/master.addr).")
    scale.add_argument("--num_workers", required=True, type=int, metavar="NUM_WORKERS",
                       help="The number of workers wanted from now on (at most the job's --max_workers).")
    scale.add_argument("--master_addr", default="", metavar="MASTER_ADDR",
                       help="host:port of the master, instead of looking it up by --job_name (default: '').")
    stop_help = ("End a running training job early: the tasks in progress finish, then the final checkpoint, "
                 "export and report (a stream job takes no new record).")
    stop = sub.add_parser("stop", help=stop_help, description=stop_help)
    stop.add_argument("--job_name", required=True, metavar="JOB_NAME",
                      help="The job to stop (its master's address is in runs/<job_name>/master.addr).")
    stop.add_argument("--master_addr", default="", metavar="MASTER_ADDR",
                      help="host:port of the master, instead of looking it up by --job_name (default: '').")
    from elasticdl.cli.zoo import add_zoo_parser

    add_zoo_parser(sub)
    return parser


def config_from_args(argv: list[str]) -> tuple[str, JobConfig]:
    from elasticdl.cli.legacy_flags import strip_legacy_flags

    args = vars(build_parser().parse_args(strip_legacy_flags(argv)))
    command = args.pop("command")
    return command, JobConfig.from_flags(**args).with_defaults()
