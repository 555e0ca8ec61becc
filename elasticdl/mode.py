"""The mode a model-zoo function is called in."""

import enum


class Mode(str, enum.Enum):
    """Passed to ``dataset_fn(dataset, mode, metadata)``.

    A ``str`` enum, so ``mode == Mode.PREDICTION`` and ``mode == "prediction"`` both
    hold, as in the original ElasticDL.
    """

    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"

    def __str__(self) -> str:
        return self.value
