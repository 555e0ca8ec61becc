"""The Python API: ``elasticdl.train(...)`` mirrors ``elasticdl train`` flag for flag.

Example::

    import elasticdl
    report = elasticdl.train(
        model_zoo="model_zoo", model_def="digits.digits_functional.custom_model",
        training_data="data/digits/train", num_workers=2, num_ps=1, output="out/model",
    )
    print(report.metrics, report.saved_model)
"""

from __future__ import annotations

import dataclasses
import logging

from elasticdl.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)


def make_config(**flags) -> JobConfig:
    """A JobConfig from keyword arguments named like the CLI flags."""
    known = {f.name for f in dataclasses.fields(JobConfig)}
    unknown = sorted(set(flags) - known)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)}; see `elasticdl train --help` for the list."
        )
    return JobConfig(**flags).with_defaults()


def run(config: JobConfig, command: str = "train"):
    """Check the job, then run it on the configured backend; returns a JobReport."""
    config.validate(command)  # flags first: no TensorFlow import for a typo
    from elasticdl.tf_runtime import quiet_tensorflow

    quiet_tensorflow()
    from elasticdl.master.job import Job
    from elasticdl.preflight import check_job

    checked = check_job(config, command)
    logger.info(
        "%s job %s: %d records in %d files, %d workers, %d PS",
        command, config.job_name, sum(n for _, n in checked.files), len(checked.files),
        config.num_workers, config.num_ps,
    )
    return Job(checked, command).run()


def train(**flags):
    """Train a model-zoo model; keyword arguments are the ``elasticdl train`` flags."""
    return run(make_config(**flags), "train")


def evaluate(**flags):
    """Evaluate a checkpoint (--checkpoint_dir_for_init) over --validation_data."""
    return run(make_config(**flags), "evaluate")


def predict(**flags):
    """Predict with a checkpoint over --prediction_data; see --prediction_outputs."""
    return run(make_config(**flags), "predict")
