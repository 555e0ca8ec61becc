"""One preprocessing state for every process: the master's, handed to each worker.

A model-zoo module that calls ``adapt()`` at import (a ``Normalization``, a ``StringLookup``,
a ``FeatureSpace``) adapts again in every process that imports it, and on data that may
differ: two workers once trained on different ``FeatureSpace`` bins. The master collects the
adapted state of its preprocessing layers and serves it (``get_preprocessing_state``, so a
worker in another pod gets it as a local one does), and each worker sets it into its own
layers: the module's (before ``custom_model()`` runs, so the model is built on the master's
vocabularies) and the model's (after). Both processes log a digest of the state; the two must
be equal.

The state of a layer is what ``adapt()`` sets and its weights do not always hold: the
variables (Normalization's mean and variance), the vocabulary of a lookup, the bin
boundaries of a Discretization. Keras 2 (tf_keras) and Keras 3 layers both have them.
"""

from __future__ import annotations

import hashlib
import io
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

@dataclass
class PreprocessingState:
    """Arrays by ``<layer key>/<kind>/<i>``; a layer key is its owner and its position."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len({key.rsplit("|", 1)[0] for key in self.arrays})

    def digest(self) -> str:
        """A short hash of every array (name, dtype, shape, bytes): equal states, equal digests."""
        h = hashlib.sha256()
        for key in sorted(self.arrays):
            value = self.arrays[key]
            h.update(f"{key}|{value.dtype.str}|{value.shape}".encode())
            h.update(value.tobytes() if value.dtype.kind != "U" else "\n".join(value.ravel().tolist()).encode())
        return h.hexdigest()[:16]

    def to_bytes(self) -> bytes:
        """An .npz file's bytes; ``b""`` for no state."""
        if not self.arrays:
            return b""
        out = io.BytesIO()
        np.savez(out, **self.arrays)  # no pickled objects: strings as unicode arrays
        return out.getvalue()

    @staticmethod
    def from_bytes(data: bytes) -> PreprocessingState:
        if not data:
            return PreprocessingState()
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return PreprocessingState({key: arrays[key] for key in arrays.files})


def is_preprocessing(layer: Any) -> bool:
    """A layer whose state ``adapt()`` sets (Normalization, Discretization, the lookups,
    TextVectorization, FeatureSpace)."""
    return not isinstance(layer, type) and callable(getattr(layer, "adapt", None))  # a layer, not its class


def _flatten(layer: Any) -> list:
    flatten = getattr(layer, "_flatten_layers", None)  # Keras 2 and 3: every nested layer, once
    return list(flatten(include_self=True, recursive=True)) if flatten else [layer]


def _module_layers(module: Any) -> list[tuple[str, Any]]:
    """(name, layer) of the module's preprocessing layers: in its global layers and models,
    and in the values of its global dicts, lists and tuples (``lookups = {"city": StringLookup()}``)."""
    found = []
    for name, value in sorted(vars(module).items()):
        if isinstance(value, types.ModuleType | type) or (isinstance(value, dict | list | tuple) and len(value) > 1000):
            continue  # imports, classes, and data (not a handful of layers)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else None
        candidates = [(name, value)] if items is None else [(f"{name}[{k}]", v) for k, v in items]
        for label, candidate in candidates:
            if isinstance(candidate, type) or not hasattr(candidate, "_flatten_layers"):
                continue  # not a Keras layer or model
            for i, layer in enumerate(_flatten(candidate)):  # a FeatureSpace's, a Sequential's layers too
                if is_preprocessing(layer) or _leaf_state(layer):
                    found.append((f"module.{label}/{i}:{type(layer).__name__}", layer))
    return found


def _model_layers(model: Any, seen: set[int]) -> list[tuple[str, Any]]:
    layers = [layer for layer in _flatten(model)[1:] if is_preprocessing(layer) and id(layer) not in seen]
    return [(f"model/{i}:{type(layer).__name__}", layer) for i, layer in enumerate(layers)]


def _leaf_state(layer: Any) -> bool:
    return any(hasattr(layer, a) for a in ("get_vocabulary", "bin_boundaries"))


def _layers_of(module: Any, model: Any) -> list[tuple[str, Any]]:
    """Every preprocessing layer, keyed the same in every process that runs the same code."""
    entries, seen = [], set()
    for key, layer in (_module_layers(module) if module is not None else []):
        if id(layer) not in seen:
            seen.add(id(layer))
            entries.append((key, layer))
    if model is not None:
        entries += _model_layers(model, seen)
    return entries


def _sublayers(layer: Any) -> int:
    return len(_flatten(layer)) - 1


def layer_state(layer: Any) -> dict[str, np.ndarray]:
    """What ``adapt()`` set in ``layer``, by kind: weights, vocabulary, bin boundaries."""
    state: dict[str, np.ndarray] = {}
    lookup = callable(getattr(layer, "get_vocabulary", None)) and callable(getattr(layer, "set_vocabulary", None))
    # A container's (FeatureSpace's) weights are its sublayers'; a lookup's state is its
    # vocabulary (Keras 2's get_weights is its table's keys, as Python objects).
    if not _sublayers(layer) and not lookup:
        for i, weight in enumerate(layer.get_weights()):
            state[f"weight/{i}"] = np.asarray(weight)
    if lookup:
        try:
            vocabulary = layer.get_vocabulary(include_special_tokens=True)
        except Exception:  # noqa: BLE001  (not adapted, no vocabulary yet: nothing to hand on)
            vocabulary = []
        if len(vocabulary):
            values = [v.decode() if isinstance(v, bytes) else v for v in vocabulary]
            state["vocabulary"] = np.asarray(values)
    boundaries = getattr(layer, "bin_boundaries", None)
    if boundaries is not None and len(boundaries) and not callable(boundaries):
        state["bin_boundaries"] = np.asarray(boundaries, dtype=np.float64)
    return state


def set_layer_state(layer: Any, state: dict[str, np.ndarray]) -> None:
    weights = [state[f"weight/{i}"] for i in range(sum(k.startswith("weight/") for k in state))]
    if weights:
        layer.set_weights(weights)
    if "vocabulary" in state:
        layer.set_vocabulary(state["vocabulary"].tolist())
    if "bin_boundaries" in state:
        layer.bin_boundaries = state["bin_boundaries"].tolist()
    if weights and type(layer).__name__ == "Normalization" and callable(getattr(layer, "finalize_state", None)):
        layer.finalize_state()  # its mean and variance tensors are derived from the weights


def collect(module: Any, model: Any) -> PreprocessingState:
    """The preprocessing state of ``module``'s layers and then of ``model``'s."""
    arrays = {}
    for key, layer in _layers_of(module, model):
        for kind, value in layer_state(layer).items():
            arrays[f"{key}|{kind}"] = value
    return PreprocessingState(arrays)


def restore(state: PreprocessingState, module: Any, model: Any) -> list[str]:
    """Set ``state`` into the layers of ``module`` (``model`` None: before the model is built),
    or into the model's own (those not in the module); the keys of ``state`` it has no layer for."""
    by_layer: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state.arrays.items():
        layer_key, kind = key.rsplit("|", 1)
        by_layer.setdefault(layer_key, {})[kind] = value
    layers = dict(_layers_of(module, model))
    # The module's layers are set before the model is built, the model's own ones after.
    wanted = [k for k in by_layer if k.startswith("module.") == (model is None)]
    missing = []
    for key in wanted:
        if key not in layers:
            missing.append(key)
            continue
        try:
            set_layer_state(layers[key], by_layer[key])
        except Exception as err:  # noqa: BLE001  (another shape, an unbuilt layer: it keeps its own)
            missing.append(f"{key} ({type(err).__name__}: {err})")
    return missing


def module_of(spec: Any) -> Any:
    """The imported model-zoo module of a ModelSpec."""
    return sys.modules.get(getattr(spec.model_fn, "__module__", ""), None)


def hand_off(spec: Any, model: Any) -> PreprocessingState:
    """The master's side: the state of its module's and its model's preprocessing layers,
    which it serves to the workers (empty when there is none)."""
    state = collect(module_of(spec), model)
    if state.arrays:
        logger.info("preprocessing state %s (%d layers) handed to the workers", state.digest(), state.layers)
    return state


class Takeover:
    """The worker's side: the master's state, set into the module's layers before
    ``custom_model()`` runs (``before_build``) and into the model's after (``after_build``).

    Without the master's state (``state`` None: a master that serves none), the worker keeps
    what its own import adapted, and says so.
    """

    def __init__(self, spec: Any, state: PreprocessingState | None):
        self.spec = spec
        self.state = state if state is None or state.arrays else None

    def before_build(self) -> None:
        if self.state is not None:
            self._report(restore(self.state, module_of(self.spec), None))

    def after_build(self, model: Any) -> None:
        module = module_of(self.spec)
        if self.state is None:
            own = collect(module, model)
            if own.arrays:
                logger.warning(
                    "no preprocessing state from the master: this worker uses the state its own import and "
                    "custom_model() adapted (%s), which other workers may not share", own.digest())
            return
        self._report(restore(self.state, module, model))
        logger.info("preprocessing state %s (%d layers) from the master", collect(module, model).digest(),
                    self.state.layers)

    def _report(self, missing: list[str]) -> None:
        if missing:
            logger.warning(
                "the master's preprocessing state names layers this worker does not have or cannot take (%s): "
                "those keep the state this worker adapted. Create the same preprocessing layers in every process (no "
                "process-dependent branches in the module or custom_model())", ", ".join(sorted(missing)[:5]))
