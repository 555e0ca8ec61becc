"""digits_weighted with a Keras Loss object as its loss: it takes the sample weights itself."""

import keras
from weightzoo.digits_weighted import custom_model, dataset_fn, eval_metrics_fn, optimizer  # noqa: F401

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
