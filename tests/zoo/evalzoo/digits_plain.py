"""The evalzoo digits model without a PredictionOutputsProcessor or callbacks."""

from evalzoo.digits_callbacks import custom_model, dataset_fn, eval_metrics_fn, loss, optimizer  # noqa: F401
