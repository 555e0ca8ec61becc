"""Export the trained model as a SavedModel that TensorFlow Serving can load.

A model with ``elasticdl.layers.Embedding`` tables is exported from its serving copy
(``Trainer.serving_model``): each table pulled whole from the parameter servers into two
weights of the layer (sorted ids and their rows, plus a zero row for ids never trained),
so serving needs no parameter server. See docs/embeddings.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref

from elasticdl import fs

logger = logging.getLogger(__name__)

# Subclassed models: Keras records the shapes of the first call but not the dtypes, so an
# int64 id input would be exported as float32. The Trainer records the real input specs.
_INPUT_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_input_signature(model, features) -> None:
    """Remember the dtypes and shapes (batch dimension free) of ``features`` for ``model``'s export."""
    import tensorflow as tf

    def spec(tensor):
        tensor = tf.convert_to_tensor(tensor)
        return tf.TensorSpec([None, *tensor.shape[1:]], tensor.dtype)

    try:
        _INPUT_SIGNATURES[model] = [tf.nest.map_structure(spec, features)]
    except (TypeError, ValueError):  # ragged or sparse inputs: leave it to Keras
        pass


@contextlib.contextmanager
def made_resources():
    """The TensorFlow resources (lookup tables) constructed inside the block, in a list."""
    from tensorflow.python.trackable import resource

    made: list = []
    original = resource.CapturableResource.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    resource.CapturableResource.__init__ = record
    try:
        yield made
    finally:
        resource.CapturableResource.__init__ = original


def _layer_traces(save: bool):
    """tf_keras's option not to save the traces of every layer's call with the model (saving
    them is its default, kept as it is when ``save``)."""
    if save:
        return contextlib.nullcontext()
    from tf_keras.src.saving.legacy.saved_model.utils import keras_option_scope

    return keras_option_scope(save_traces=False, in_tf_saved_model_scope=False)


def export_saved_model(model, path: str) -> str:
    """Write ``model`` with a ``serving_default`` signature to ``path`` (replaced if present)."""
    logger.info("exporting the SavedModel to %s", path)  # said first: tracing and writing take seconds
    return _export(model, path)


def _export(model, path: str) -> str:
    from elasticdl.model.keras_generation import legacy_active

    if fs.is_remote(path):  # TensorFlow writes local files only: export here, then upload the tree
        with tempfile.TemporaryDirectory(prefix="elasticdl-export-") as local:
            _export(model, os.path.join(local, "model"))
            fs.put_dir(os.path.join(local, "model"), path)
        logger.info("SavedModel uploaded to %s", path)
        return path
    if os.path.exists(path):
        shutil.rmtree(path)
    if legacy_active():
        return _export_keras2(model, path)
    import keras

    # Keras 3's exporter traces model.call with the input spec it recorded when built.
    signature = None
    if not isinstance(model, (keras.Sequential, keras.src.models.Functional)):
        signature = _INPUT_SIGNATURES.get(model)
    model.export(path, format="tf_saved_model", verbose=False, input_signature=signature)
    logger.info("SavedModel written to %s", path)
    return path


def _export_keras2(model, path: str) -> str:
    """A Keras 2 (tf_keras) model: ``tf.saved_model.save`` with a ``serving_default`` traced on the
    input specs the Trainer recorded (feature-column models take a dict of named inputs), and a
    ``serve`` function as Keras 3's export has: the model's outputs as they are, for
    ``tf.saved_model.load(path).serve(features)``. The outputs of ``serving_default`` are named
    as Keras 3 names them: a dict's keys, else ``output_0``, ``output_1``, ..."""
    import tensorflow as tf

    signature = _INPUT_SIGNATURES.get(model)
    if signature is None:
        raise ValueError("the model was never called on a batch: no input signature to export")

    # The model is traced once, in serve; serving_default calls it (tracing a big model twice
    # added seconds to every export).
    raw = tf.function(lambda features: model(features, training=False), input_signature=signature)

    def outputs(features):
        result = raw(features)
        if isinstance(result, dict):
            return result
        if isinstance(result, (list, tuple)):
            return {f"output_{i}": t for i, t in enumerate(result)}
        return {"output_0": result}

    spec = signature[0]
    if isinstance(spec, dict):  # named inputs (feature columns): one signature input per feature
        keys = list(spec)
        named = [tf.TensorSpec(spec[k].shape, spec[k].dtype, name=k) for k in keys]
        serving = tf.function(lambda *args: outputs(dict(zip(keys, args))), input_signature=named)
    else:
        serving = tf.function(outputs, input_signature=signature)

    # Tables a layer makes in its call() (the original zoo's lookup layers) are made while
    # tracing, owned by no layer: saved as the model's too, else TensorFlow refuses the export
    # ("references an 'untracked' resource").
    with made_resources() as resources:
        concrete = serving.get_concrete_function()
    # Saved as attributes of the model (the SavedModel's root), then taken off again.
    model.serve = raw
    if resources:
        model.elasticdl_call_resources = resources
        # Saving retraces a tf.function (its own context), which would make new tables; the
        # trace made above, with the tables it uses, is saved instead.
        model.serve = raw.get_concrete_function()
    try:
        # Keras's own traces of every layer's call would make more such tables, in functions
        # no root reaches: a model that made tables is saved with its two endpoints only.
        with _layer_traces(save=not resources):
            tf.saved_model.save(model, path, signatures={"serving_default": concrete})
    finally:
        del model.serve
        if resources:
            del model.elasticdl_call_resources
    logger.info("SavedModel written to %s", path)
    return path
