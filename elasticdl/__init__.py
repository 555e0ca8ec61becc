"""ElasticDL: elastic parameter-server training for Keras models.

``elasticdl.train(...)`` mirrors ``elasticdl train``; ``elasticdl.Mode`` is passed to
``dataset_fn``.
"""

from elasticdl.mode import Mode

__version__ = "0.1.0"
__all__ = ["Mode", "evaluate", "predict", "scale", "stop", "train", "__version__"]


def train(**flags):
    """Train a model-zoo model; see ``elasticdl.api.train``."""
    from elasticdl import api

    return api.train(**flags)


def evaluate(**flags):
    """Evaluate a checkpoint; see ``elasticdl.api.evaluate``."""
    from elasticdl import api

    return api.evaluate(**flags)


def predict(**flags):
    """Batch prediction with a checkpoint; see ``elasticdl.api.predict``."""
    from elasticdl import api

    return api.predict(**flags)


def scale(job_name: str, num_workers: int, master_addr: str = "") -> str:
    """Change the number of workers of a running job; see ``elasticdl.api.scale``."""
    from elasticdl import api

    return api.scale(job_name, num_workers, master_addr)


def stop(job_name: str, master_addr: str = "") -> str:
    """End a running training job early, finished as usual; see ``elasticdl.api.stop``."""
    from elasticdl import api

    return api.stop(job_name, master_addr)
