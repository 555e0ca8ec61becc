"""ElasticDL: elastic parameter-server training for Keras models.

``elasticdl.train(...)`` mirrors ``elasticdl train``; ``elasticdl.Mode`` is passed to
``dataset_fn``.
"""

from elasticdl.mode import Mode

__version__ = "0.1.0"
__all__ = ["Mode", "train", "__version__"]


def train(**flags):
    """Train a model-zoo model; see ``elasticdl.api.train``."""
    from elasticdl.api import train as _train

    return _train(**flags)
