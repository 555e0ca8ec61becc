"""The ``elasticdl`` command: argparse at the edge (elasticdl/cli/parser.py), a typed
JobConfig below it, and one mapping of errors to messages and exit codes (elasticdl/errors.py).
"""

from __future__ import annotations

import os
import sys
import time

from elasticdl.cli.parser import build_parser, config_from_args
from elasticdl.errors import REPORTED, report_exit
from elasticdl.logs import configure_logging

__all__ = ["build_parser", "config_from_args", "main"]


def _scale_main(argv: list[str]) -> int:
    from elasticdl.api import scale

    args = build_parser().parse_args(argv)
    try:
        print(scale(job_name=args.job_name, num_workers=args.num_workers, master_addr=args.master_addr))
    except REPORTED as err:
        return report_exit("elasticdl scale", err)
    return 0


def _stop_main(argv: list[str]) -> int:
    from elasticdl.api import stop

    args = build_parser().parse_args(argv)
    try:
        print(stop(job_name=args.job_name, master_addr=args.master_addr))
    except REPORTED as err:
        return report_exit("elasticdl stop", err)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``elasticdl`` command; ``argv`` None: this process's own command line (after Ctrl-C,
    the process then exits at once, see ``_run``)."""
    if argv is None:
        return _run(sys.argv[1:], own_process=True)
    return _run(argv, own_process=False)


def _run(argv: list[str], own_process: bool) -> int:
    if argv[:1] == ["scale"]:
        return _scale_main(argv)
    if argv[:1] == ["stop"]:
        return _stop_main(argv)
    if argv[:1] == ["zoo"]:
        from elasticdl.cli.zoo import main as zoo_main

        return zoo_main(argv)
    try:
        command, config = config_from_args(argv)  # structured flags are parsed here
    except REPORTED as err:
        return report_exit(f"elasticdl {argv[0]}", err)
    configure_logging(config.job.logging_level, "master")
    from elasticdl.model.tf_runtime import configure_tensorflow

    def set_up_tensorflow() -> None:
        # After the checks that need no TensorFlow (a typo fails at once), before its import.
        # The master process only checks the model and exports it: one thread leaves the
        # cores to the workers. (The Python API leaves the caller's TensorFlow alone.)
        configure_tensorflow(1)

    from elasticdl.api import run
    from elasticdl.cli.interrupt import CtrlC, continuation
    from elasticdl.launch.child import exit_now

    program = f"elasticdl {command}"
    started = time.time()
    try:
        # A Kubernetes client only submits (TensorFlow runs in the pods) and follows the master's
        # log: its Ctrl-C stops following (launch/kubernetes/submit.py), not the job.
        local = config.job.backend != "kubernetes"
        with CtrlC(program, config.checkpoints.checkpoint_dir if command == "train" else "", enabled=local):
            report = run(config, command, before_tensorflow=set_up_tensorflow if local else None)
    except REPORTED as err:  # an ElasticDLError: one message, exit code 2 or 1; a bug keeps its traceback
        code = report_exit(program, err)
        if isinstance(err, KeyboardInterrupt):
            how = continuation(os.path.join(config.job.run_dir, "report.json"), started)
            if how:
                print(f"{program}: {how}", file=sys.stderr, flush=True)
            if own_process:
                # Every role is stopped and the report written: the interpreter's own teardown
                # (TensorFlow's, gRPC's) took 1.5 s more, past the 2 s Ctrl-C promises.
                exit_now(code)
        return code
    print(report.to_json())
    if own_process:  # the roles are stopped and the report written: see exit_now
        exit_now(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
