"""Keras 2 (``tf_keras``) or Keras 3: which one a model-zoo module is written for, and using it.

TensorFlow picks its Keras once, when it is imported: ``tf.keras`` is Keras 3 unless
``TF_USE_LEGACY_KERAS=1`` is set before, and then it is ``tf_keras`` (Keras 2, the
``tf-keras`` package, installed without its dependencies: ``make keras2``). Feature columns, ``DenseFeatures``,
``tensorflow.python.keras`` imports and raw TensorFlow ops on Keras tensors work only with
Keras 2. So the generation is decided from the module's *source text*, before TensorFlow is
imported anywhere, and every role process sets the variable before it imports TensorFlow.

``--keras_version auto`` (the default) reads the module and the model-zoo modules it
imports; ``2`` or ``3`` decide it outright. Everything here is TensorFlow-free except
``keras_module`` and ``variable_name``, which run after the import.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from elasticdl.errors import UserError

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
KERAS_VERSIONS = ("auto", "2", "3")

# What in a module's text means Keras 2, with the reason shown at submit time.
_SIGNS: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(pattern, re.MULTILINE), reason) for pattern, reason in (
        (r"^\s*(import|from)\s+tf_keras\b", "imports tf_keras"),
        (r"\bfeature_column\b", "uses feature columns"),
        (r"\bDenseFeatures\b", "uses DenseFeatures"),
        (r"\btensorflow\.python\.keras\b", "imports tensorflow.python.keras"),
        (r"\btf\.keras\.backend\b|^\s*import\s+tensorflow\.keras\.backend\b", "uses tf.keras.backend on Keras tensors"),
    )
)
# tf.keras meant Keras 2 until TensorFlow 2.16; a module that writes it and never imports
# Keras 3 itself (``import keras``) was written for Keras 2.
_TF_KERAS = re.compile(r"\btf\.keras\.|^\s*(import|from)\s+tensorflow\.keras\b", re.MULTILINE)
_KERAS3 = re.compile(r"^\s*(import|from)\s+keras\b", re.MULTILINE)
_ZOO_IMPORT = re.compile(r"^\s*from\s+(model_zoo\.[\w.]+|\.[\w.]*)\s+import|^\s*import\s+(model_zoo\.[\w.]+)", re.MULTILINE)


class KerasVersionError(UserError, ValueError):
    """The Keras generation asked for cannot be used in this process."""


@dataclass(frozen=True)
class KerasChoice:
    version: str  # "2" or "3"
    reason: str  # why: the flag, or what the module's text shows

    def describe(self) -> str:
        name = "Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1)" if self.version == "2" else "Keras 3"
        return f"{name}: {self.reason}"


def _imported_zoo_files(text: str, module_path: str, model_zoo: str) -> list[str]:
    """Model-zoo files the module imports (``from model_zoo.x.y import``, ``from .y import``)."""
    files = []
    for match in _ZOO_IMPORT.finditer(text):
        name = match.group(1) or match.group(2)
        if name.startswith("."):
            base = os.path.dirname(module_path)
            parts = name.lstrip(".").split(".") if name.strip(".") else []
        else:
            base = os.path.dirname(os.path.abspath(model_zoo))  # model_zoo.x.y: the zoo's parent
            parts = name.split(".")
            if parts[0] != os.path.basename(os.path.abspath(model_zoo)):
                base = os.path.abspath(model_zoo)
                parts = parts[1:]
        path = os.path.join(base, *parts) + ".py" if parts else ""
        if path and os.path.isfile(path):
            files.append(path)
    return files


def detect(module_path: str, model_zoo: str = "") -> KerasChoice:
    """Keras 2 when the module (or a model-zoo module it imports) shows a Keras 2 sign, else 3."""
    seen: set[str] = set()
    todo = [module_path]
    while todo:
        path = todo.pop()
        if path in seen or len(seen) > 20:
            continue
        seen.add(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        for pattern, reason in _SIGNS:
            if pattern.search(text):
                where = os.path.basename(path)
                return KerasChoice("2", f"--keras_version auto: {where} {reason}")
        if _TF_KERAS.search(text) and not _KERAS3.search(text):
            where = os.path.basename(path)
            return KerasChoice("2", f"--keras_version auto: {where} writes tf.keras and never imports keras (Keras 3)")
        todo.extend(_imported_zoo_files(text, path, model_zoo or os.path.dirname(module_path)))
    return KerasChoice("3", "--keras_version auto: no Keras 2 idiom found in the module")


def module_file(model_zoo: str, model_def: str) -> str:
    module_name = model_def.rpartition(".")[0]
    return os.path.join(model_zoo, *module_name.split(".")) + ".py"


def choose(flag: str, model_zoo: str, model_def: str) -> KerasChoice:
    """The generation for ``--keras_version flag``; ``auto`` reads the module's text."""
    if flag not in KERAS_VERSIONS:
        raise KerasVersionError(f"--keras_version must be auto, 2 or 3. Received: {flag!r}")
    if flag != "auto":
        return KerasChoice(flag, f"--keras_version {flag}")
    return detect(module_file(model_zoo, model_def), model_zoo)


def legacy_active() -> bool:
    return os.environ.get(LEGACY_ENV, "").strip().lower() in ("1", "true", "yes")


def _tensorflow_minor() -> str:
    """The installed TensorFlow's X.Y, which tf-keras's version must match (tf-keras 2.21 for TF 2.21)."""
    import importlib.metadata

    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return ".".join(importlib.metadata.version(name).split(".")[:2])
        except importlib.metadata.PackageNotFoundError:
            continue
    return "X.Y"


def activate(version: str) -> None:
    """Make this process (and the children it starts) use Keras ``version``.

    Must run before TensorFlow is imported; if it already was with the other generation,
    the process cannot switch, and the message says what to do.
    """
    if version == "2":
        try:
            import importlib.util

            missing = importlib.util.find_spec("tf_keras") is None
        except (ImportError, ValueError):
            missing = True
        if missing:
            raise KerasVersionError(
                "the model-zoo module is written for Keras 2 (tf_keras), which is not installed: "
                f"pip install --no-deps 'tf-keras~={_tensorflow_minor()}.0' (`make keras2` in ElasticDL's "
                "clone; without --no-deps, tf-keras adds the `tensorflow` distribution beside tensorflow-cpu), "
                "or pass --keras_version 3 if the module runs on Keras 3."
            )
    want_legacy = version == "2"
    if "tensorflow" in sys.modules and legacy_active() != want_legacy:
        raise KerasVersionError(
            f"TensorFlow was imported with Keras {'2' if legacy_active() else '3'} before ElasticDL chose "
            f"Keras {version} for the model: set {LEGACY_ENV}={'1' if want_legacy else '0'} in the "
            "environment before importing TensorFlow (or pass --keras_version to match)."
        )
    os.environ[LEGACY_ENV] = "1" if want_legacy else "0"


def keras_module():
    """The Keras the model is written with: ``tf_keras`` under Keras 2, else ``keras``."""
    if legacy_active():
        import tf_keras

        return tf_keras
    import keras

    return keras


def variable_name(var) -> str:
    """A variable's stable name: Keras 3's ``path``, Keras 2's ``name`` without ``:0``."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = var.name
    return name[:-2] if name.endswith(":0") else name


_ANNOUNCED: list = []  # once per process: the CLI and the API both settle


def settle(config, announce: bool = True):
    """``config`` with ``--keras_version`` decided (2 or 3), that Keras made this process's.

    Run before TensorFlow is imported, in every process that imports it: the submitting
    process (which says which Keras it chose), the master pod and each worker. Children
    started by this process inherit ``TF_USE_LEGACY_KERAS``; pods decide again from their
    config (the same module text gives the same answer).
    """
    import logging

    section = config.model_zoo_functions
    training = config.training
    if section.keras_version == "auto" and not os.path.isfile(module_file(training.model_zoo, training.model_def)):
        return config  # a Kubernetes client without the zoo: the master pod decides
    choice = choose(section.keras_version, training.model_zoo, training.model_def)
    activate(choice.version)
    if announce and not _ANNOUNCED:
        _ANNOUNCED.append(choice)
        logging.getLogger(__name__).info("the model-zoo module runs on %s", choice.describe())
    if choice.version == section.keras_version:
        return config
    return config.replace(keras_version=choice.version)


def feed_dicts_as_keras2_did(model) -> None:
    """Let a Keras 2 functional model whose ``Input``s are a list (or one tensor) take a dict the
    way tf.keras 2 took it when the original ElasticDL ran: by the Inputs' names when the dict has
    them all, else the dict's values in key order (``tf.nest.flatten``). Newer tf_keras checks the
    names first and refuses an unnamed ``Input`` (``input_1``) fed ``{"feature": ...}`` ("Missing
    data for input"), though its own mapping below that check still falls back to key order.
    Only a model with an unnamed Input loses that check (``input_spec`` None); its layers still
    check the shapes. Named Inputs already take a dict by name, and keep it."""
    if not legacy_active():
        return
    nested = getattr(model, "_nested_inputs", None)
    if nested is None or isinstance(nested, dict) or not getattr(model, "_is_graph_network", False):
        return  # subclassed models, and Inputs given as a dict (keyed by name already)
    import tf_keras

    if isinstance(model, tf_keras.Sequential):
        return
    if any(_UNNAMED_INPUT.match(x._keras_history.layer.name) for x in model.inputs):
        model.input_spec = None


_UNNAMED_INPUT = re.compile(r"input(_\d+)?$")  # tf_keras's names for an Input given none
