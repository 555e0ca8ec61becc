"""Embedding tables (rows by id, on the PS or in process) and the Keras layer that reads them."""
