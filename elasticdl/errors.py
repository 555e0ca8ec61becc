"""ElasticDL's error tree, and the one place that turns an error into a message and an exit code.

Every error ElasticDL means a user to see is an :class:`ElasticDLError`, on one of two
branches:

- :class:`UserError` (exit code 2): the input is wrong: a flag, the model-zoo module, the
  data, a Kubernetes request the user can fix (RBAC, namespace, a name in use). Fix it
  and run again.
- :class:`JobFailure` (exit code 1): the job ran and could not finish: a role died, the
  state store was lost, the cluster refused or did not answer. Running again may work.

Module errors keep their builtin base where callers catch it (``ConfigError`` is also a
``ValueError``). A family base that has children on both branches (``K8sError``) is on
neither; :func:`exit_status` treats such a base raised as is as a job failure.

The programs (``elasticdl`` in elasticdl/cli/__init__.py, the in-cluster master in
elasticdl/cli/master_pod.py) catch :data:`REPORTED` and print :func:`exit_status`'s
message; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


class ElasticDLError(Exception):
    """Root of the errors ElasticDL reports to the user as a message, not a traceback."""


class UserError(ElasticDLError):
    """The input is wrong (a flag, the model zoo, the data, a fixable Kubernetes request).

    The message names what is wrong and how to fix it; nothing runs again until it is fixed.
    Exit code 2."""


class JobFailure(ElasticDLError):
    """The job ran and could not finish (a role died, the store was lost, the cluster refused).

    The input was accepted; the message says what failed. Running again may succeed.
    Exit code 1."""


class JobFailedError(JobFailure, RuntimeError):
    """The job could not finish; the message says which role failed and why."""


class TrainingDivergedError(UserError, ArithmeticError):
    """The loss or the gradients were NaN or Inf for several batches in a row.

    Raised by a worker (which then pushes nothing more) and by the master, which fails the
    job with it: running again with the same learning rate and inputs diverges again."""


# What the programs catch and report with exit_status(); anything else is a bug (traceback).
REPORTED = (ElasticDLError, KeyboardInterrupt)


def exit_status(err: BaseException) -> tuple[int, str]:
    """``(exit code, message)`` for an error that ends an ElasticDL program.

    - :class:`UserError`: ``(2, "error: <message>")``;
    - :class:`JobFailure`, or an :class:`ElasticDLError` on neither branch:
      ``(1, "job failed: <message>")``;
    - :class:`KeyboardInterrupt`: ``(130, "interrupted: ...")``;
    - anything else is a bug: ``(1, "internal error: <type>: <message>")``; the programs
      catch only :data:`REPORTED`, so a bug keeps its traceback.

    The message is the error's own text (its first line names the problem), prefixed as
    above; an error with no text is named by its class.
    """
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted: every process this command started was stopped"
    text = str(err).strip() or type(err).__name__
    if isinstance(err, UserError):
        return EXIT_USER_ERROR, f"error: {text}"
    if isinstance(err, ElasticDLError):
        return EXIT_JOB_FAILED, f"job failed: {text}"
    return EXIT_JOB_FAILED, f"internal error: {type(err).__name__}: {text}"


def report_exit(program: str, err: BaseException) -> int:
    """Print ``<program>: <message>`` (see :func:`exit_status`) to stderr; the exit code.

    The programs' one way out on an error::

        try:
            report = run(config, command)
        except REPORTED as err:
            return report_exit(f"elasticdl {command}", err)
    """
    code, message = exit_status(err)
    lead = "\n" if isinstance(err, KeyboardInterrupt) else ""  # past the terminal's ^C
    print(f"{lead}{program}: {message}", file=sys.stderr, flush=True)
    return code
