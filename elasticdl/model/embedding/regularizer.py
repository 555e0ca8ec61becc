"""``embeddings_regularizer`` on a parameter-server table: L1 and L2, on the rows a batch touches.

A Keras Embedding's regularizer penalizes the whole table at every step
(``l1 * sum(|table|) + l2 * sum(table**2)``), so every row shrinks at every step. A table on
the PS has no whole to penalize: the worker adds the penalty of the rows its batch looked up
(each unique id once per lookup) to the loss, as TensorFlow's sparse apply
(``tf.nn.embedding_lookup`` plus a regularizer on the gathered rows) does. The tape then gives
each touched row ``2 * l2 * row + l1 * sign(row)`` on top of its data gradient: the dense
Keras update restricted to those rows. Rows the batch does not touch are left alone (lazily,
like the PS's Adam and momentum). docs/embeddings.md, "Regularizers".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elasticdl.errors import UserError

# Keras 3 and Keras 2 (tf_keras) regularizers of these classes are the sums this module computes.
_KINDS = {"L1": ("l1",), "L2": ("l2",), "L1L2": ("l1", "l2")}


class RegularizerError(UserError, ValueError):
    """An ``embeddings_regularizer`` a parameter-server table cannot apply; says what to use."""


def _resolve(regularizer):
    """A Keras regularizer object from what a layer accepts ("l1", "l2", a config dict, an object)."""
    if isinstance(regularizer, (str, dict)):
        import keras

        try:
            return keras.regularizers.get(regularizer)
        except ValueError:
            raise RegularizerError(
                f"`embeddings_regularizer` {regularizer!r} is not a Keras regularizer; use 'l1', 'l2', "
                "keras.regularizers.L1(...), L2(...) or L1L2(...)"
            ) from None
    return regularizer


@dataclass(frozen=True)
class RowRegularizer:
    """``l1 * sum(|rows|) + l2 * sum(rows**2)`` over the looked-up rows of one table.

    Example::

        reg = RowRegularizer.from_keras(keras.regularizers.L2(1e-6))  # RowRegularizer(l1=0.0, l2=1e-06)
        loss += reg.penalty(rows)  # rows: the batch's unique rows, watched by the tape
    """

    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        for name in ("l1", "l2"):
            value = getattr(self, name)
            if not isinstance(value, float) or not np.isfinite(value) or value < 0:
                raise RegularizerError(f"`{name}` must be a finite float >= 0. Received: {name}={value!r}")

    @classmethod
    def from_keras(cls, regularizer) -> RowRegularizer | None:
        """The factors of a Keras L1, L2 or L1L2 regularizer (None for None); RegularizerError,
        naming what to use instead, for any other (its penalty may not split by row)."""
        if regularizer is None:
            return None
        regularizer = _resolve(regularizer)
        kind = type(regularizer).__name__
        module = type(regularizer).__module__
        # Exact classes only: a subclass may compute something else in __call__.
        if kind not in _KINDS or not module.startswith(("keras.", "tf_keras.")):
            raise RegularizerError(
                f"`embeddings_regularizer` {kind} is not supported on parameter-server tables: they apply "
                "L1, L2 and L1L2 to the rows a batch touches. Use keras.regularizers.L1, L2 or L1L2, or "
                "add your own penalty of the layer's output with add_loss."
            )
        config = regularizer.get_config()
        return cls(**{name: float(config.get(name) or 0.0) for name in _KINDS[kind]})

    def to_keras(self):
        """The same regularizer for a Keras 3 local table (a run without parameter servers)."""
        import keras

        return keras.regularizers.L1L2(l1=self.l1, l2=self.l2)

    def penalty(self, rows):
        """The penalty of ``rows`` (a float32 tensor [n, dim]) as a scalar tensor."""
        import tensorflow as tf

        total = tf.constant(0.0, tf.float32)
        if self.l1:
            total += self.l1 * tf.reduce_sum(tf.abs(rows))
        if self.l2:
            total += self.l2 * tf.reduce_sum(tf.square(rows))
        return total

    def __call__(self, rows):  # a regularizer callable, as tf_keras's add_weight takes one
        return self.penalty(rows)

    def describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name):g}" for name in ("l1", "l2") if getattr(self, name))
