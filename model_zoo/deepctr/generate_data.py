"""A synthetic click-through data set with a known logistic ground truth, as TFRecord.

    python model_zoo/deepctr/generate_data.py --output data/deepctr

Eight categorical fields with 5 to 1,000,000 distinct ids each. Ids are drawn with a
Zipf-like skew (a few ids are frequent, most are rare) and shuffled, so frequent ids are
spread over the id range (and over the parameter servers, which hold id ``i`` on PS
``i % num_ps``). Every field's ids are offset so that no two fields share an id: one
embedding table serves all fields.

The click probability is a factorization machine with known parameters::

    logit = bias + sum_f w[id_f] + sum_{f<g} <v[id_f], v[id_g]>,   label ~ Bernoulli(sigmoid(logit))

where an id's weight and factor shrink with its frequency rank (rare ids matter little,
as in real click logs). The best AUC any model can reach on the test split is the AUC of
the true probabilities; it is printed and written to ``meta.json`` as ``auc_ceiling``.

Each record is a tf.train.Example with ``ids`` (8 int64, one per field, already offset)
and ``label`` (int64 0/1). Every run with the same arguments writes the same files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

# (distinct ids, Zipf exponent of their frequencies) per field.
FIELDS: tuple[tuple[int, float], ...] = (
    (1_000_000, 1.1),
    (200_000, 1.1),
    (50_000, 1.05),
    (10_000, 1.0),
    (1_000, 0.9),
    (100, 0.7),
    (20, 0.5),
    (5, 0.0),
)
NUM_FIELDS = len(FIELDS)
OFFSETS = tuple(int(x) for x in np.cumsum([0] + [n for n, _ in FIELDS[:-1]]))
VOCABULARY = sum(n for n, _ in FIELDS)  # 1,261,125 ids in all
FACTOR_DIM = 4
BIAS = -1.0
WEIGHT_SCALE = 0.8
FACTOR_SCALE = 0.2
RANK_SCALE = 10.0  # an id of frequency rank r has weight and factor scaled by 1/sqrt(1 + r/10)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], scores.size]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    positives = labels.sum()
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


class GroundTruth:
    """The generating model: per-field id frequencies, weights and factors (by frequency rank)."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fields = []
        for size, exponent in FIELDS:
            ranks = np.arange(size, dtype=np.float64)
            probabilities = (ranks + 1.0) ** -exponent
            probabilities /= probabilities.sum()
            scale = 1.0 / np.sqrt(1.0 + ranks / RANK_SCALE)
            self.fields.append({
                "cdf": np.cumsum(probabilities),
                "id_of_rank": rng.permutation(size).astype(np.int64),
                "weight": (WEIGHT_SCALE * rng.standard_normal(size) * scale).astype(np.float32),
                "factor": (FACTOR_SCALE * rng.standard_normal((size, FACTOR_DIM)) * scale[:, None]).astype(np.float32),
            })

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n, fields] offset per field, click probability [n], label [n])."""
        ids = np.empty((n, NUM_FIELDS), np.int64)
        logit = np.full(n, BIAS, np.float64)
        factors = np.zeros((n, FACTOR_DIM), np.float64)
        squares = np.zeros((n, FACTOR_DIM), np.float64)
        for f, field in enumerate(self.fields):
            rank = np.minimum(np.searchsorted(field["cdf"], rng.random(n), side="right"), field["cdf"].size - 1)
            ids[:, f] = OFFSETS[f] + field["id_of_rank"][rank]
            logit += field["weight"][rank]
            v = field["factor"][rank].astype(np.float64)
            factors += v
            squares += v * v
        logit += 0.5 * (factors * factors - squares).sum(axis=1)  # sum over field pairs of <v_f, v_g>
        probability = 1.0 / (1.0 + np.exp(-logit))
        label = (rng.random(n) < probability).astype(np.int64)
        return ids, probability, label


def _examples(ids: np.ndarray, labels: np.ndarray):
    import tensorflow as tf

    for row, label in zip(ids, labels):
        yield tf.train.Example(features=tf.train.Features(feature={
            "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row.tolist())),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
        })).SerializeToString()


def generate(output: str, train_records: int = 20_000, test_records: int = 10_000, seed: int = 0,
             train_files: int = 2) -> dict:
    """Write ``output/{train,test}/*.tfrecord`` and ``output/meta.json``; returns the metadata."""
    from elasticdl.data.tfrecord import write_records

    truth = GroundTruth(seed)
    rng = np.random.default_rng(seed + 1)
    train_ids, _, train_labels = truth.sample(train_records, rng)
    test_ids, test_probability, test_labels = truth.sample(test_records, rng)
    for split, ids, labels, parts in (
        ("train", train_ids, train_labels, train_files),
        ("test", test_ids, test_labels, 1),
    ):
        folder = os.path.join(output, split)
        os.makedirs(folder, exist_ok=True)
        for part, rows in enumerate(np.array_split(np.arange(len(labels)), parts)):
            write_records(os.path.join(folder, f"part-{part:03d}.tfrecord"), _examples(ids[rows], labels[rows]))
    meta = {
        "auc_ceiling": round(auc(test_labels, test_probability), 6),
        "train_records": train_records,
        "test_records": test_records,
        "click_rate": round(float(train_labels.mean()), 6),
        "distinct_ids_in_train": int(np.unique(train_ids).size),
        "vocabulary": VOCABULARY,
        "fields": [{"distinct_ids": n, "zipf_exponent": a, "offset": o} for (n, a), o in zip(FIELDS, OFFSETS)],
        "seed": seed,
    }
    with open(os.path.join(output, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/deepctr")
    parser.add_argument("--train_records", type=int, default=20_000)
    parser.add_argument("--test_records", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    meta = generate(args.output, args.train_records, args.test_records, args.seed)
    print(
        f"wrote {args.train_records} training and {args.test_records} test records to {args.output}/{{train,test}} "
        f"({meta['distinct_ids_in_train']} distinct ids in training, click rate {meta['click_rate']:.3f})"
    )
    print(f"AUC ceiling (the true click probabilities on the test split): {meta['auc_ceiling']:.4f}")


if __name__ == "__main__":
    main()
