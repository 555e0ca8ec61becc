"""The worker: task loop, PS client and the TensorFlow trainer."""
