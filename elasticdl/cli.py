"""The ``elasticdl`` command: argparse at the edge, a typed JobConfig below it.

The parser is built from JobConfig's fields, so every flag, its default and its help
live in one place (elasticdl/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from elasticdl.config import JobConfig
from elasticdl.errors import REPORTED, report_exit
from elasticdl.logs import configure_logging

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
    hints = typing.get_type_hints(JobConfig)
    for f in dataclasses.fields(JobConfig):
        if command not in f.metadata.get("commands", ()):
            continue
        names = [f"--{f.name}", *f.metadata.get("aliases", ())]
        kind = hints[f.name]
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        if kind is bool:
            parser.add_argument(*names, dest=f.name, type=parse_bool, nargs="?", const=True,
                                default=f.default, metavar="BOOL", help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, type=kind, default=f.default,
                                metavar=f.name.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
                       help="The number of workers wanted from now on.")
    scale.add_argument("--master_addr", default="", metavar="MASTER_ADDR",
                       help="host:port of the master, instead of looking it up by --job_name (default: '').")
    from elasticdl.zoo import add_zoo_parser

    add_zoo_parser(sub)
    return parser


def config_from_args(argv: list[str]) -> tuple[str, JobConfig]:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    return command, JobConfig(**args).with_defaults()


def _scale_main(argv: list[str]) -> int:
    from elasticdl.api import scale

    args = build_parser().parse_args(argv)
    try:
        print(scale(job_name=args.job_name, num_workers=args.num_workers, master_addr=args.master_addr))
    except REPORTED as err:
        return report_exit("elasticdl scale", err)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:
        return _scale_main(argv)
    if argv[:1] == ["zoo"]:
        from elasticdl.zoo import main as zoo_main

        return zoo_main(argv)
    command, config = config_from_args(argv)
    configure_logging(config.logging_level, "master")
    from elasticdl.tf_runtime import configure_tensorflow, quiet_tensorflow

    # The master process only checks the model and exports it: one thread leaves the
    # cores to the workers. (The Python API leaves the caller's TensorFlow alone.)
    if config.backend != "kubernetes":  # a Kubernetes client only submits: TensorFlow runs in the pods
        quiet_tensorflow()
        configure_tensorflow(1)
    from elasticdl.api import run

    try:
        report = run(config, command)
    except REPORTED as err:  # an ElasticDLError: one message, exit code 2 or 1; a bug keeps its traceback
        return report_exit(f"elasticdl {command}", err)
    print(report.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
