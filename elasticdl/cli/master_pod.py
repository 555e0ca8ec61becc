"""The in-cluster master: the command of the master pod the client submits.

``python -m elasticdl.cli.master_pod --command train`` reads its JobConfig from
``$ELASTICDL_JOB_CONFIG`` (set by the client), checks the job where the model zoo and
the data are (inside the cluster), then runs the same job loop as local mode with a
``KubernetesBackend``. The pod's exit code is the job's outcome (elasticdl/errors.py):
0 done, 1 the job failed, 2 the input is wrong (a flag, the model zoo, the data, RBAC).
The last line of its log is the report, after ``ELASTICDL_REPORT``, which the client
picks up.
"""

from __future__ import annotations

import json
import logging
import os

from elasticdl.cli.argparser import ElasticDLParser
from elasticdl.config import COMMANDS, ConfigError, JobConfig
from elasticdl.errors import REPORTED, report_exit
from elasticdl.launch.kubernetes import manifests
from elasticdl.launch.kubernetes.manifests import REPORT_MARKER
from elasticdl.logs import configure_logging

logger = logging.getLogger("elasticdl.master_pod")


def main(argv: list[str] | None = None) -> int:
    parser = ElasticDLParser(description=__doc__)
    parser.add_argument("--command", choices=COMMANDS, default="train")
    args = parser.parse_args(argv)
    try:
        report = _run(args.command)
    except REPORTED as err:  # an ElasticDLError: one message, exit code 2 or 1; a bug keeps its traceback
        return report_exit(f"elasticdl {args.command}", err)
    print(report.to_json(), flush=True)
    print(REPORT_MARKER + json.dumps(json.loads(report.to_json()), sort_keys=True), flush=True)
    return 0


def _run(command: str):
    if manifests.JOB_CONFIG_ENV not in os.environ:
        raise ConfigError(f"${manifests.JOB_CONFIG_ENV} is not set: this runs in the master pod the client creates")
    # Values of --envs reach this pod from the job's Secret, never in its config: a config
    # written by hand with values keeps them out of the PS and worker pods all the same.
    config = manifests.without_secret_values(JobConfig.from_json(os.environ[manifests.JOB_CONFIG_ENV]))
    configure_logging(config.job.logging_level, "master")
    from elasticdl.model.keras_generation import settle
    from elasticdl.model.tf_runtime import configure_tensorflow, quiet_tensorflow

    config = settle(config)  # Keras 2 or 3, before TensorFlow is imported
    quiet_tensorflow()
    configure_tensorflow(1)
    from elasticdl.api import run
    from elasticdl.launch.kubernetes.backend import KubernetesBackend
    from elasticdl.launch.kubernetes.client import K8sClient

    owner = {
        "apiVersion": "v1", "kind": "Pod",
        "name": os.environ[manifests.POD_NAME_ENV], "uid": os.environ[manifests.POD_UID_ENV],
    }
    backend = KubernetesBackend(
        config, K8sClient(config.kubernetes.namespace), owner,
        manifests.ClusterSpec(os.environ.get(manifests.CLUSTER_SPEC_ENV, ""), "--cluster_spec"),
    )
    return run(config, command, backend=backend)


if __name__ == "__main__":
    raise SystemExit(main())
