"""The model shared by every role: the model-zoo contract, the trainer, metrics, export,
checkpoints, optimizers, variable placement and embedding tables."""
