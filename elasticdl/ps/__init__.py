"""The parameter server: shards, optimizers, updating strategies, checkpoints."""
