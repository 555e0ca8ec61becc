"""The original ElasticDL's flags that mean nothing here, or cannot work: taken off the command
line before parsing, each with a warning (ignored) or a refusal naming the alternative."""

from __future__ import annotations

import logging

from elasticdl.config import ConfigError

logger = logging.getLogger(__name__)

# flag -> why it is ignored
IGNORED = {
    "--need_elasticdl_job_service": "the master always serves the job",
    "--log_loss_steps": "the loss is reported with every task",
    "--restart_policy": "the master relaunches roles itself (see --relaunch_on_worker_failure)",
    "--extra_pypi_index": "it belongs to `elasticdl zoo init`",
    "--force_use_kube_config_file": "the Kubernetes client loads the in-cluster config, else ~/.kube/config",
    "--aux_params": "it has no meaning here",
    "--log_file_path": "logs go to --log_dir",
    "--use_go_ps": "the parameter servers are Python processes",
    "--need_tf_config": "it has no meaning here",
    "--image_base": "build the image with `elasticdl zoo build`",
    "--docker_image_repository": "push the image with `elasticdl zoo push`",
    "--data_reader_params_check": "it has no meaning here",
    "--output_dir": "use --output",
}
# Every flag of the original that is taken off the command line (docs may name them).
LEGACY_FLAGS = frozenset(IGNORED) | {"--distribution_strategy"}
_STRATEGY_OK = {"", "parameterserverstrategy", "local"}


def strip_legacy_flags(argv: list[str]) -> list[str]:
    """``argv`` without the original's flags above; ConfigError for one that cannot work."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, has_value, value = arg.partition("=")
        if name in IGNORED or name == "--distribution_strategy":
            if not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            if name == "--distribution_strategy":
                _check_strategy(value)
            else:
                logger.warning("ignoring the original ElasticDL's %s: %s", name, IGNORED[name])
        else:
            out.append(arg)
        i += 1
    return out


def _check_strategy(value: str) -> None:
    if value.strip().lower() in _STRATEGY_OK:
        logger.warning(
            "ignoring --distribution_strategy %s: ElasticDL always trains with parameter servers "
            "(--num_ps; a job of one worker is the local case)", value or "''",
        )
        return
    if value.strip().lower() == "allreducestrategy":
        raise ConfigError(
            "--distribution_strategy AllreduceStrategy is not supported: ElasticDL trains with parameter "
            "servers only (elastic AllReduce needs a collective-communication layer it does not have). "
            "Drop the flag and use --num_ps; sync SGD (the default) gives the same updates."
        )
    raise ConfigError(
        f"--distribution_strategy {value!r} is unknown: the original's values were ParameterServerStrategy, "
        "AllreduceStrategy and Local; here every job uses parameter servers, so drop the flag."
    )
