"""Large ``keras.layers.Embedding`` layers become ``elasticdl.layers.Embedding`` while a model is built.

Inside ``swap_large_embeddings(threshold_bytes)``, constructing a ``keras.layers.Embedding``
whose table (``input_dim * output_dim * 4`` bytes) is larger than the threshold returns an
``elasticdl.layers.Embedding`` with the same name, sizes, initializer and ``mask_zero``
and L1/L2 ``embeddings_regularizer`` instead, so the table is never allocated in the process
and lives on the parameter servers. Construction is intercepted (``Embedding.__new__``), not
the finished model, so functional, Sequential and subclassed models are all covered. Layers
that use what a PS table does not support (another regularizer, a constraint, LoRA,
quantization, initial ``weights``, a frozen or non-float32 table) stay Keras layers, with a
warning that says what to change for the layer to swap.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.regularizer import RegularizerError, RowRegularizer

logger = logging.getLogger(__name__)
_REPORTED: set[str] = set()  # a process builds the model several times: log each decision once

DEFAULT_THRESHOLD_MB = 2.0
_MIB = 1024 * 1024


def threshold_bytes(threshold_mb: float) -> int | None:
    """--embedding_swap_threshold_mb in bytes; None (never swap) when negative."""
    return None if threshold_mb < 0 else int(threshold_mb * _MIB)


def swap_policy(training) -> TablePolicy:
    """The bounds (--embedding_admit_min_count, --embedding_ttl_versions, --embedding_max_rows)
    of the tables the swap makes, from the job's training settings."""
    return TablePolicy(
        admit_min_count=training.embedding_admit_min_count,
        ttl_versions=training.embedding_ttl_versions,
        max_rows=training.embedding_max_rows,
    )


# Why a layer cannot swap, and what to change so that it does.
_FIXES = {
    "embeddings_constraint": "remove `embeddings_constraint` (PS tables apply no constraint)",
    "weights": "remove `weights=` and give the rows an `embeddings_initializer` (or load them from a "
               "checkpoint with --checkpoint_dir_for_init)",
    "lora_rank": "remove `lora_rank`",
    "quantization_config": "remove `quantization_config` (quantize the exported model instead)",
}


def _why_not(bound: dict, kwargs: dict) -> str:
    """'' when the layer can swap, else the reason and what to change in the model."""
    for arg, fix in _FIXES.items():
        if bound.get(arg) is not None:
            return f"`{arg}` is not supported on parameter-server tables; to swap it, {fix}"
    if kwargs.get("trainable") is False:
        return "it is not trainable; to swap it, drop `trainable=False`"
    dtype = kwargs.get("dtype")
    if dtype is not None and str(getattr(dtype, "name", dtype)) not in ("float32", "mixed_float16", "mixed_bfloat16"):
        return f"its dtype is {dtype}; parameter-server tables are float32: to swap it, pass dtype='float32'"
    try:
        RowRegularizer.from_keras(bound.get("embeddings_regularizer"))
    except RegularizerError as err:
        return str(err)
    return ""


def _swapped(args: tuple, kwargs: dict, threshold: int, policy: TablePolicy):
    from keras.src.layers.core.embedding import Embedding as KerasEmbedding

    from elasticdl.model.embedding.layer import Embedding, initializer_spec

    try:
        bound = inspect.signature(KerasEmbedding.__init__).bind(None, *args, **kwargs).arguments
    except TypeError:
        return None  # let Keras raise its own error
    extra = dict(bound.pop("kwargs", {}))
    input_dim, output_dim = bound.get("input_dim"), bound.get("output_dim")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (input_dim, output_dim)):
        return None
    size = input_dim * output_dim * 4
    if size <= threshold:
        return None
    name = f" {extra['name']!r}" if extra.get("name") else ""
    described = f"keras Embedding{name} ({input_dim} x {output_dim}, {size / _MIB:.2f} MiB)"
    reason = _why_not(bound, extra)
    initializer = bound.get("embeddings_initializer", "uniform")
    if not reason:
        try:
            initializer_spec(initializer, input_dim, output_dim)
        except ValueError as err:
            reason = str(err)
    if reason:
        _log_once(
            logging.WARNING,
            "%s stays a dense variable on one parameter server, pulled whole at every step: %s "
            "(or raise --embedding_swap_threshold_mb above %.2f to keep it dense and silence this)",
            described, reason, size / _MIB,
        )
        return None
    regularizer = bound.get("embeddings_regularizer")
    layer = Embedding(
        output_dim,
        input_dim=input_dim,
        embeddings_initializer=initializer,
        mask_zero=bool(bound.get("mask_zero", False)),
        embeddings_regularizer=regularizer,
        input_length=extra.pop("input_length", None),
        **policy.to_dict(),
        **extra,
    )
    settings = [f"{k}={v}" for k, v in policy.to_dict().items()]
    if layer._regularizer is not None:
        settings.append(f"regularizer {layer._regularizer.describe()} on the rows each batch touches")
    bounds = ", ".join(settings)
    _log_once(
        logging.INFO,
        "%s is larger than --embedding_swap_threshold_mb=%g: swapped for elasticdl.layers.Embedding "
        "%r, its rows live on the parameter servers%s",
        described, threshold / _MIB, layer.name, f" ({bounds})" if bounds else "",
    )
    return layer


def _log_once(level: int, message: str, *args) -> None:
    text = message % args
    if text not in _REPORTED:
        _REPORTED.add(text)
        logger.log(level, text)


@contextlib.contextmanager
def swap_large_embeddings(threshold: int | None, policy: TablePolicy | None = None) -> Iterator[None]:
    """Within the block, Keras Embeddings larger than ``threshold`` bytes are built PS-backed,
    their tables bounded by ``policy``."""
    from keras.src.layers.core.embedding import Embedding as KerasEmbedding

    if threshold is None or "__new__" in KerasEmbedding.__dict__:  # off, or already active
        yield
        return

    def __new__(cls, *args, **kwargs):
        if cls is KerasEmbedding:  # not user subclasses: they may rely on the Keras table
            layer = _swapped(args, kwargs, threshold, policy or TablePolicy())
            if layer is not None:
                return layer  # not a KerasEmbedding, so Python does not call __init__ again
        return super(KerasEmbedding, cls).__new__(cls, *args, **kwargs)

    KerasEmbedding.__new__ = __new__
    try:
        yield
    finally:
        del KerasEmbedding.__new__
