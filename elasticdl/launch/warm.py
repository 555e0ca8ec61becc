"""Warm spares: role processes that import their modules before they have a job to do.

A local backend starts ``python -m elasticdl.launch.warm <role>``. The spare imports what the
role's entry point needs (a worker: TensorFlow and Keras, 2-3 s of a 2-core machine, most
of a cold worker's time to its first gradient) and then blocks on its stdin.
``LocalBackend.start`` hands it the role's command line as one JSON line (with the time it
was sent: the role's start-up clock runs from there), and the spare runs
the role's ``main`` from there: the job's first workers, a scale-up and a relaunch start
with TensorFlow already imported. EOF instead of a command line: the spare was not needed
and exits 0.

Why not fork new workers from one process that imported TensorFlow (a "fork server")?
After ``import numpy`` OpenBLAS runs a thread of its own and ``import tensorflow`` starts
one more: a fork copies a process whose other threads may hold locks, and the child has no
such threads to release them. Each spare is a process started afresh instead.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys
import time

from elasticdl.launch.child import die_with_parent, exit_now

# The entry point of each role, by name: the launch layer sits below the roles.
ROLE_MODULES = {"ps": "elasticdl.ps.main", "worker": "elasticdl.worker.main"}


def _assigned() -> bool:
    """Whether the command line is there already: what is left of a warm-up is then skipped
    rather than delaying the role (its result would come too late to help)."""
    return bool(select.select([sys.stdin], [], [], 0)[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ROLE_MODULES:
        sys.stderr.write(f"usage: python -m elasticdl.launch.warm {{{','.join(ROLE_MODULES)}}} "
                         "[the role's arguments known already, for its warm_up]\n")
        return 2
    role, known = argv[0], argv[1:]
    die_with_parent()
    module = importlib.import_module(ROLE_MODULES[role])
    warm_up = getattr(module, "warm_up", None)
    if warm_up is not None:  # it may stop early once its command line is there (see _assigned)
        warm_up(known, _assigned)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed: the job ended (or the backend stopped) first
    order = json.loads(line)  # {"args": the role's command line, "sent": its time.time(), "env": its own}
    os.environ.update(order.get("env", {}))  # a worker's credential: known only once its index is
    assigned_at = time.monotonic() - max(0.0, time.time() - order["sent"])
    return module.main(order["args"], assigned_at=assigned_at)


if __name__ == "__main__":
    exit_now(main())  # see exit_now: a role leaves at once
