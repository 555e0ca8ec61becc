"""A PS or worker pod's entry point: ``python -m elasticdl.launch.kubernetes.pod_entry MODULE ARGS...``.

The master passes files (the job config, the optimizer spec) in the pod's environment;
an argument ``env:NAME`` is replaced by a file holding ``$NAME``. Then MODULE runs as
``python -m MODULE ARGS...`` would.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile


def materialize(args: list[str], directory: str) -> list[str]:
    out = []
    for arg in args:
        if arg.startswith("env:"):
            name = arg[4:]
            if name not in os.environ:
                raise SystemExit(f"elasticdl launch: {arg} names an environment variable the pod does not have")
            path = os.path.join(directory, name.lower() + ".json")
            with open(path, "w", encoding="utf-8") as f:
                f.write(os.environ[name])
            arg = path
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m elasticdl.launch.kubernetes.pod_entry MODULE [ARGS...]")
    module, args = argv[0], materialize(argv[1:], tempfile.mkdtemp(prefix="elasticdl-"))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
