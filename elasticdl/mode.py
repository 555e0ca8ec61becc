"""The mode a model-zoo function is called in."""

import enum


class Mode(enum.StrEnum):
    """Passed to ``dataset_fn(dataset, mode, metadata)``.

    A string enum, so ``mode == Mode.PREDICTION`` and ``mode == "prediction"`` both
    hold, as in the original ElasticDL.
    """

    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"
