"""JobConfig: the job's sections, built from flat flags, checked before anything starts.

``JobConfig`` holds one dataclass per section (elasticdl/config/sections.py). ``from_flags``,
``replace`` and ``from_json`` take flags by name (``minibatch_size=32``) and check each value
by the rule of its type (elasticdl/config/fields.py); ``validate`` checks every flag again
(a section may be built by hand) and the rules between flags.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticdl import fs
from elasticdl.config.consistency import ConsistencySection
from elasticdl.config.errors import ConfigError
from elasticdl.config.fields import COMMANDS, Bounds, check_value
from elasticdl.config.kubernetes import OptionError, validate_kubernetes_flags
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
from elasticdl.config.stream import StreamSection
from elasticdl.config.suggest import flag_hint

BACKENDS = ("local", "kubernetes")


@dataclass
class JobConfig:
    """Everything a job needs, in sections. Build it from flags with ``JobConfig.from_flags(...)``,
    the CLI or ``elasticdl.train(...)``."""

    training: TrainingSection = field(default_factory=TrainingSection)
    model_zoo_functions: ModelZooSection = field(default_factory=ModelZooSection)
    data: DataSection = field(default_factory=DataSection)
    stream: StreamSection = field(default_factory=StreamSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    consistency: ConsistencySection = field(default_factory=ConsistencySection)
    elasticity: ElasticitySection = field(default_factory=ElasticitySection)
    checkpoints: CheckpointSection = field(default_factory=CheckpointSection)
    outputs: OutputSection = field(default_factory=OutputSection)
    job: JobSection = field(default_factory=JobSection)
    kubernetes: KubernetesSection = field(default_factory=KubernetesSection)

    # ---------------------------------------------------------------- the flat edge

    @classmethod
    def from_flags(cls, **flags: Any) -> JobConfig:
        """A JobConfig from flags named like the command line's (``minibatch_size=32``).

        A structured flag takes its command-line text (``model_params="a=1;b=2"``) or the typed
        value it stands for; a value that does not parse raises ConfigError naming the flag.
        """
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, raw in _known(flags).items():
            sections[FLAGS[name].section][name] = FLAGS[name].value(raw)
        return cls(**{name: SECTIONS[name](**values) for name, values in sections.items()})

    def to_flags(self) -> dict[str, Any]:
        """Every flag by name, structured ones as text: ``from_flags(**c.to_flags()) == c``."""
        return {name: f.text(self.flag_value(name)) for name, f in FLAGS.items()}

    def flag_value(self, name: str) -> Any:
        """The (typed) value of flag ``name``, from its section."""
        return getattr(getattr(self, FLAGS[name].section), name)

    def replace(self, **flags: Any) -> JobConfig:
        """A copy with some flags changed (by flag name, as ``from_flags`` takes them)."""
        config = copy.deepcopy(self)
        for name, raw in _known(flags).items():
            setattr(getattr(config, FLAGS[name].section), name, FLAGS[name].value(raw))
        return config

    def to_json(self) -> str:
        """The flags by section, as on the command line (what the roles' processes read)."""
        flags = self.to_flags()
        return json.dumps(
            {section: {name: flags[name] for name, f in FLAGS.items() if f.section == section}
             for section in SECTIONS},
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        flags: dict[str, Any] = {}
        for section, values in json.loads(text).items():
            if section not in SECTIONS:
                raise ConfigError(f"the job config has an unknown section {section!r} ({', '.join(SECTIONS)})")
            for name, value in values.items():
                if name in FLAGS and FLAGS[name].section != section:
                    raise ConfigError(f"the job config has {name} in {section!r}; it belongs to {FLAGS[name].section!r}")
                flags[name] = value
        return cls.from_flags(**flags)

    # ---------------------------------------------------------------- derived values

    @property
    def effective_records_per_task(self) -> int:
        return self.data.records_per_task or self.training.minibatch_size * self.data.num_minibatches_per_task

    def with_defaults(self) -> JobConfig:
        """Fill the defaults that depend on other fields."""
        cfg = copy.deepcopy(self)
        cfg.job.log_level = cfg.job.log_level.upper()
        if not cfg.job.job_name:  # a DNS label that fits Kubernetes' names: elasticdl-<model>-<time>
            model = suggest_job_name(cfg.training.model_def.rsplit(".", 2)[0], max_length=30)
            cfg.job.job_name = f"elasticdl-{model}-{time.strftime('%Y%m%d-%H%M%S')}"
        if not cfg.outputs.prediction_outputs:
            cfg.outputs.prediction_outputs = os.path.join(cfg.job.run_dir, "predictions")
        return cfg

    # ---------------------------------------------------------------- validation

    def validate(self, command: str = "train", check_paths: bool = True) -> None:
        """Raise ConfigError for flags that cannot work, before anything starts.

        Every flag first by the rule of its type and its range (elasticdl/config/fields.py),
        then the rules between flags. Structured flags were parsed when the config was built.
        ``check_paths=False``: a Kubernetes client, where paths name files in the pods.
        """
        training, data, checkpoints = self.training, self.data, self.checkpoints
        for name, f in FLAGS.items():  # a section built by hand skipped from_flags' checks
            if f.parse is None:
                check_value(name, f.kind, self.flag_value(name), f.bounds)
        if command not in COMMANDS:
            raise ConfigError(f"Unknown command {command!r}; use one of {', '.join(COMMANDS)}.")
        if self.job.job_name:  # empty until with_defaults() names the job
            check_job_name(self.job.job_name)
        if not training.model_zoo:
            raise ConfigError("--model_zoo is required: the directory holding your model-zoo packages.")
        if check_paths and not os.path.isdir(training.model_zoo):
            raise ConfigError(f"--model_zoo {training.model_zoo!r} is not a directory.")
        if not training.model_def or "." not in training.model_def:
            raise ConfigError(
                f"--model_def must be pkg.module.name under --model_zoo "
                f"(e.g. digits.digits_functional.custom_model). Received: {training.model_def!r}"
            )
        if training.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(
                f"--wire_dtype must be one of {', '.join(WIRE_DTYPES)}. Received: {training.wire_dtype!r}"
            )
        if training.tensor_transport not in TENSOR_TRANSPORTS:
            raise ConfigError(
                f"--tensor_transport must be one of {', '.join(TENSOR_TRANSPORTS)}. "
                f"Received: {training.tensor_transport!r}"
            )
        if self.model_zoo_functions.keras_version not in ("auto", "2", "3"):
            raise ConfigError(
                f"--keras_version must be auto, 2 or 3. Received: {self.model_zoo_functions.keras_version!r}"
            )
        if command == "train" and not data.training_data:
            raise ConfigError("--training_data is required for `elasticdl train`.")
        self.stream.check(data.training_data, self.outputs.output)
        if command == "evaluate" and not data.validation_data:
            raise ConfigError("--validation_data is required for `elasticdl evaluate`.")
        if command == "predict" and not data.prediction_data:
            raise ConfigError("--prediction_data is required for `elasticdl predict`.")
        if command in ("evaluate", "predict") and not checkpoints.checkpoint_dir_for_init:
            raise ConfigError(
                f"--checkpoint_dir_for_init is required for `elasticdl {command}`: the model to "
                f"{command} (a checkpoint written by `elasticdl train --checkpoint_dir`)."
            )
        if self.evaluation.evaluation_steps and not data.validation_data:
            raise ConfigError("--evaluation_steps needs --validation_data: what should be evaluated?")
        problem = self.elasticity.workers_problem(self.elasticity.num_workers) or self.elasticity.replicas_problem()
        if problem:
            raise ConfigError(problem)
        if self.job.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}. Received: {self.job.backend!r}")
        if self.job.backend == "kubernetes":
            try:
                validate_kubernetes_flags(self)
            except OptionError as err:
                raise ConfigError(str(err)) from None
        if self.job.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(
                f"--log_level must be one of {', '.join(LOG_LEVELS)}. Received: {self.job.log_level!r}"
            )
        self.consistency.validate()
        if checkpoints.checkpoint_steps and not checkpoints.checkpoint_dir:
            raise ConfigError("--checkpoint_steps needs --checkpoint_dir: where should checkpoints go?")
        init = checkpoints.checkpoint_dir_for_init
        if check_paths and init and not fs.exists(init):
            raise ConfigError(f"--checkpoint_dir_for_init {init!r} does not exist.")
        if check_paths:
            self._validate_checkpoint_dir(command)
            self._validate_output_dirs(command)

    def _validate_output_dirs(self, command: str) -> None:
        """Every directory the job writes is a writable directory, or creatable, with room: found
        now, not when the job ends (the final checkpoint, the export, the report). On
        Kubernetes this runs in the master pod, where the volumes are mounted as in every pod."""
        job, outputs = self.job, self.outputs
        dirs = [("runs/<job_name> (the job's directory)", job.run_dir), ("--log_dir", job.log_dir)]
        if command == "train":
            dirs += [("--checkpoint_dir", self.checkpoints.checkpoint_dir), ("--output", outputs.output)]
        if command in ("train", "evaluate"):
            dirs.append(("--tensorboard_log_dir", outputs.tensorboard_log_dir))
        if command == "predict":
            dirs.append(("--prediction_outputs", outputs.prediction_outputs))
        for flag, path in dirs:
            check_writable_dir(flag, path)

    def _validate_checkpoint_dir(self, command: str) -> None:
        """A fresh job must not mix its versions with an old job's: they would collide and be pruned."""
        directory, init = self.checkpoints.checkpoint_dir, self.checkpoints.checkpoint_dir_for_init
        if command != "train" or not directory or not fs.isdir(directory):
            return
        old = [e for e in fs.listdir(directory) if e.startswith("version-")]
        same_dir = init and os.path.abspath(init).startswith(os.path.abspath(directory))
        if old and not same_dir and not self.elasticity.etcd_endpoints:  # with etcd, a restarted master resumes
            raise ConfigError(
                f"--checkpoint_dir {directory!r} already holds checkpoints ({len(old)} versions). "
                f"Pass --checkpoint_dir_for_init {directory} to continue from the latest, "
                "or choose an empty directory."
            )


# ---------------------------------------------------------------- the flags of the sections


@dataclass(frozen=True)
class Flag:
    """One flag: the field ``name`` of section ``section`` (an attribute of JobConfig)."""

    name: str
    section: str
    kind: type  # on the command line: str, int, float or bool
    default: Any  # as on the command line (a structured flag's text)
    help: str
    commands: tuple[str, ...]
    aliases: tuple[str, ...]
    parse: Callable[[str], Any] | None = None  # structured flags: text -> typed value
    render: Callable[[Any], str] | None = None  # and back
    bounds: Bounds = Bounds()  # a number's range
    held: type = str  # the type the section holds (a structured flag's parsed value: dict, float ...)

    @property
    def option(self) -> str:
        return f"--{self.name}"

    def value(self, raw: Any) -> Any:
        """The section's value for what a user passed: checked by its type's rule (a
        structured flag's text is parsed); ConfigError naming the flag."""
        if self.parse is None:
            return check_value(self.name, self.kind, raw, self.bounds)
        if not isinstance(raw, str):  # the typed value itself: checked by writing it as text
            if self.held in (bool, int, float):  # True is no fraction, though it writes as "high"
                check_value(self.name, self.held, raw, Bounds(low=None))
            try:
                raw = self.render(raw)
            except (TypeError, AttributeError, ValueError):
                raise ConfigError(
                    f"{self.option} takes text like {self.default!r} (or what it stands for). Received: {raw!r}"
                ) from None
        return self.parse(raw)

    def text(self, value: Any) -> Any:
        """The value as the command line would give it."""
        return self.render(value) if self.render is not None else value


def _section_flags() -> tuple[dict[str, type], dict[str, Flag]]:
    sections = typing.get_type_hints(JobConfig)
    flags: dict[str, Flag] = {}
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in flags:
                raise TypeError(f"--{f.name} is in two sections: {flags[f.name].section} and {section}")
            meta = f.metadata
            structured = "parse" in meta
            flags[f.name] = Flag(
                name=f.name, section=section, kind=str if structured else hints[f.name],
                default=meta["text"] if structured else f.default, help=meta["help"],
                commands=meta["commands"], aliases=meta["aliases"],
                parse=meta.get("parse"), render=meta.get("render"), bounds=meta.get("bounds", Bounds()),
                held=hints[f.name] if isinstance(hints[f.name], type) else object,
            )
    return sections, flags


# Section attribute -> section class, in the order of --help; flag name -> Flag, by section.
SECTIONS, FLAGS = _section_flags()


def _known(flags: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        hints = [f"{name}: {hint}" for name in unknown if (hint := flag_hint(name, FLAGS, prefix=''))]
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)}; see `elasticdl train --help` for the list."
            + "".join(f"\n{hint}" for hint in hints)
        )
    return flags
