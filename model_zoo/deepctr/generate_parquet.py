"""The synthetic click-through data set as Parquet, with a multi-hot column, locally or on S3.

    python model_zoo/deepctr/generate_parquet.py --output data/deepctr-parquet
    python model_zoo/deepctr/generate_parquet.py --output s3://bucket/ctr --train_rows 4000000

Columns: ``f0`` .. ``f7`` (int64: one id per field, 5 to 1,000,000 distinct ids each, offset
so no two fields share an id, as in generate_data.py), ``tags`` (list<int64>: 0 to
``MAX_TAGS`` ids out of ``NUM_TAGS``, Zipf-skewed, offset past every field's ids) and
``label`` (int64 0/1). The click probability is generate_data.py's factorization machine
over the fields plus a known weight per tag::

    logit = bias + sum_f w[id_f] + sum_{f<g} <v[id_f], v[id_g]> + sum_t u[t]

so ``meta.json``'s ``auc_ceiling`` (the AUC of the true probabilities on the test split) is
the best any model can do. Files are written in row groups of ``--row_group_rows`` (a task
of that many records reads one row group). The same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepctr.generate_data import NUM_FIELDS, VOCABULARY, GroundTruth, auc  # noqa: E402

NUM_TAGS = 10_000
MAX_TAGS = 4
TAG_OFFSET = VOCABULARY  # tag t has id TAG_OFFSET + t: one embedding table serves fields and tags
PAD_ID = TAG_OFFSET + NUM_TAGS  # fills the unused tag slots of a row (the models' choice, not the data's)
TAG_SCALE = 0.6


class TagTruth:
    """Tag frequencies (Zipf, exponent 1) and weights (shrinking with frequency rank)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed + 100)
        ranks = np.arange(NUM_TAGS, dtype=np.float64)
        probabilities = 1.0 / (ranks + 1.0)
        self.cdf = np.cumsum(probabilities / probabilities.sum())
        self.id_of_rank = rng.permutation(NUM_TAGS).astype(np.int64)
        self.weight = TAG_SCALE * rng.standard_normal(NUM_TAGS) / np.sqrt(1.0 + ranks / 10.0)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(list offsets [n + 1], tag ids, summed weight per row [n])."""
        counts = rng.integers(0, MAX_TAGS + 1, n)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        rank = np.minimum(np.searchsorted(self.cdf, rng.random(int(offsets[-1])), side="right"), NUM_TAGS - 1)
        weights = np.bincount(np.repeat(np.arange(n), counts), self.weight[rank], minlength=n)
        return offsets, TAG_OFFSET + self.id_of_rank[rank], weights


def _table(ids, offsets, tags, labels):
    import pyarrow as pa

    columns = {f"f{f}": pa.array(ids[:, f]) for f in range(NUM_FIELDS)}
    columns["tags"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tags, pa.int64()))
    columns["label"] = pa.array(labels)
    return pa.table(columns)


def _write(table, path: str, row_group_rows: int) -> None:
    import pyarrow.parquet as pq

    from elasticdl import fs

    fs.makedirs(os.path.dirname(path) if not fs.is_remote(path) else path)
    with fs.open(path, "wb") as f:
        pq.write_table(table, f, row_group_size=row_group_rows)


def generate(output: str, train_rows: int = 20_000, test_rows: int = 5_000, seed: int = 0, train_files: int = 2,
             row_group_rows: int = 4096) -> dict:
    """Write ``output/{train,test}/part-*.parquet`` and ``output/meta.json``; returns the metadata."""
    from elasticdl import fs

    truth, tag_truth = GroundTruth(seed), TagTruth(seed)
    rng = np.random.default_rng(seed + 1)
    meta: dict = {"seed": seed, "num_tags": NUM_TAGS, "max_tags": MAX_TAGS, "tag_offset": TAG_OFFSET,
                  "pad_id": PAD_ID, "row_group_rows": row_group_rows}
    for split, rows, parts in (("train", train_rows, train_files), ("test", test_rows, 1)):
        for part, n in enumerate(np.diff(np.linspace(0, rows, parts + 1).astype(np.int64))):
            ids, probability, _ = truth.sample(int(n), rng)
            offsets, tags, tag_weight = tag_truth.sample(int(n), rng)
            logit = np.log(probability) - np.log1p(-probability) + tag_weight
            probability = 1.0 / (1.0 + np.exp(-logit))
            labels = (rng.random(int(n)) < probability).astype(np.int64)
            _write(_table(ids, offsets, tags, labels), fs.join(output, split, f"part-{part:03d}.parquet"),
                   row_group_rows)
            if split == "test":
                meta["auc_ceiling"] = round(auc(labels, probability), 6)
                meta["click_rate"] = round(float(labels.mean()), 6)
        meta[f"{split}_rows"] = rows
    with fs.open(fs.join(output, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/deepctr-parquet", help="a directory, or s3://bucket/prefix")
    parser.add_argument("--train_rows", type=int, default=20_000)
    parser.add_argument("--test_rows", type=int, default=5_000)
    parser.add_argument("--train_files", type=int, default=2)
    parser.add_argument("--row_group_rows", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    meta = generate(args.output, args.train_rows, args.test_rows, args.seed, args.train_files, args.row_group_rows)
    print(f"wrote {args.train_rows} training and {args.test_rows} test rows to {args.output}/{{train,test}}; "
          f"AUC ceiling {meta['auc_ceiling']:.4f}")


if __name__ == "__main__":
    main()
