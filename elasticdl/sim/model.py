"""The workers' model computation, a numpy stand-in: linear regression on generated records.

A record's gradient is a function of the record and the parameters only, so the simulator
knows exactly which records each push carries. Dense variables are named so that every PS
holds at least one (placement by name hash, elasticdl/model/sharding.py); with an embedding
table, each record also looks up one row (id = record index % EMBEDDING_IDS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elasticdl.model.embedding.table import IndexedRows, TableInfo
from elasticdl.model.sharding import partition_ids, ps_for_variable

EMBEDDING = "emb"
EMBEDDING_IDS = 5
LEARNING_RATE = 0.05


def variable_names(num_ps: int) -> list[str]:
    """One dense variable per PS (the first candidate name hashed to it)."""
    names: dict[int, str] = {}
    k = 0
    while len(names) < num_ps:
        name = f"w{k}"
        names.setdefault(ps_for_variable(name, num_ps), name)
        k += 1
    return [names[ps] for ps in range(num_ps)]


@dataclass
class Dataset:
    """``records`` records of one file: features (one per variable) and a target."""

    path: str
    features: np.ndarray  # [records, variables] float32
    targets: np.ndarray  # [records] float32

    @classmethod
    def generate(cls, rng, records: int, variables: int) -> Dataset:
        truth = np.array([rng.uniform(-1, 1) for _ in range(variables)], np.float32)
        features = np.array([[rng.uniform(-1, 1) for _ in range(variables)] for _ in range(records)], np.float32)
        return cls("sim://records", features, features @ truth)


class LinearModel:
    """A worker's copy of the parameters and its gradients on a batch of record indices."""

    def __init__(self, names: list[str], embedding: bool) -> None:
        self.names = names
        self.embedding = embedding
        self.params: dict[str, np.ndarray] = {n: np.zeros(1, np.float32) for n in names}
        self.rows: dict[int, np.ndarray] = {}  # the embedding rows last pulled

    @property
    def table_infos(self) -> list[TableInfo]:
        return [TableInfo(EMBEDDING, 1)] if self.embedding else []

    def set_params(self, params: dict) -> None:
        for name, value in params.items():
            if name in self.params:
                self.params[name] = np.array(value, np.float32).reshape(1)

    def gradients(self, data: Dataset, indices: list[int]) -> tuple[float, dict]:
        x = data.features[indices]
        w = np.array([self.params[n][0] for n in self.names], np.float32)
        ids = np.array([i % EMBEDDING_IDS for i in indices], np.int64)
        prediction = x @ w
        if self.embedding:
            prediction = prediction + np.array([self.rows.get(int(i), np.zeros(1))[0] for i in ids], np.float32)
        error = prediction - data.targets[indices]
        grads: dict = {n: np.array([np.mean(error * x[:, k])], np.float32) for k, n in enumerate(self.names)}
        if self.embedding:
            unique = np.unique(ids)
            sums = np.array([[error[ids == i].sum() / len(indices)] for i in unique], np.float32)
            grads[EMBEDDING] = IndexedRows(unique, sums)
        return float(np.mean(error ** 2)), grads

    def predict(self, data: Dataset, indices: list[int]) -> np.ndarray:
        w = np.array([self.params[n][0] for n in self.names], np.float32)
        prediction = data.features[indices] @ w
        if self.embedding:
            ids = [i % EMBEDDING_IDS for i in indices]
            prediction = prediction + np.array([self.rows.get(i, np.zeros(1))[0] for i in ids], np.float32)
        return prediction

    def apply_locally(self, grads: dict) -> None:
        for name in self.names:
            self.params[name] = self.params[name] - LEARNING_RATE * grads[name]


def eval_metrics() -> dict:
    """The evaluation's metrics: a plain function, merged by the real MetricsMerger."""
    return {"mse": lambda labels, predictions: (np.asarray(labels) - np.asarray(predictions)) ** 2}


def split(grads: dict, num_ps: int) -> list[dict]:
    """The real placement: dense arrays by name hash, embedding rows by id % num_ps."""
    parts: list[dict] = [{} for _ in range(num_ps)]
    for name, value in grads.items():
        if isinstance(value, IndexedRows):
            for ps, positions in enumerate(partition_ids(value.ids, num_ps)):
                if positions.size:
                    parts[ps][name] = IndexedRows(value.ids[positions], value.values[positions])
        else:
            parts[ps_for_variable(name, num_ps)][name] = value
    return parts
