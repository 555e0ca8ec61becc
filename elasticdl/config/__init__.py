"""Typed job configuration in sections, validated before any process starts.

``JobConfig`` (elasticdl/config/job_config.py) holds one dataclass per section
(elasticdl/config/sections.py): ``config.training.minibatch_size``,
``config.consistency.use_async``, ``config.kubernetes.volume`` ... The edge stays flat: the
command line (elasticdl/cli/parser.py), the Python API (``elasticdl.train(minibatch_size=...)``)
and ``JobConfig.from_flags`` take the flags by name, and structured flags are parsed there,
once, into typed values (elasticdl/config/structured.py). Every field carries its help and a
number its range in ``metadata`` (elasticdl/config/fields.py), so the CLI, the Python API and
the generated CLI reference (docs/cli.md) cannot drift apart.

This module only re-exports: the package's modules import one another downwards and never
the package itself (the import-linter contracts in pyproject.toml).
"""

from __future__ import annotations

from elasticdl.config.consistency import ConsistencySection
from elasticdl.config.errors import ConfigError
from elasticdl.config.fields import COMMANDS
from elasticdl.config.job_config import BACKENDS, FLAGS, SECTIONS, Flag, JobConfig
from elasticdl.config.paths import check_job_name, check_writable_dir, suggest_job_name
from elasticdl.config.sections import (
    LOG_LEVELS,
    TENSOR_TRANSPORTS,
    WIRE_DTYPES,
    CheckpointSection,
    DataSection,
    ElasticitySection,
    EvaluationSection,
    JobSection,
    KubernetesSection,
    ModelZooSection,
    OutputSection,
    TrainingSection,
)
from elasticdl.config.structured import parse_kv_params, render_kv_params

__all__ = [
    "BACKENDS", "COMMANDS", "FLAGS", "LOG_LEVELS", "SECTIONS", "TENSOR_TRANSPORTS", "WIRE_DTYPES",
    "CheckpointSection", "ConfigError", "ConsistencySection", "DataSection", "ElasticitySection",
    "EvaluationSection", "Flag", "JobConfig", "JobSection", "KubernetesSection", "ModelZooSection",
    "OutputSection", "TrainingSection", "check_job_name", "check_writable_dir", "parse_kv_params",
    "render_kv_params", "suggest_job_name",
]
