"""Benchmark data: TFRecord files of tf.train.Example, written without TensorFlow.

- digits: scikit-learn's digits, the same stratified train split as
  model_zoo/digits/prepare_data.py (1,437 records: ``image`` 64 floats, ``label``);
  without scikit-learn, synthetic records of the same shape. ``copies``: the split written
  that many times over (longer epochs).
- dense: synthetic records, ``x`` = ``dim`` normal floats, ``label`` = argmax of a fixed
  random projection (learnable, so the loss falls as in a real job).
- ctr: model_zoo/deepctr/generate_data.py's click data (its ground truth and seeds: the
  training split its ``generate(train_records=records)`` writes), ``ids`` = 8 int64 ids
  folded modulo ``vocabulary`` (the hashing trick, so that a table of exactly that many
  rows holds every id), ``label`` = 0/1.
- ratings: ``ids`` = (user, movie) pairs, ``label`` = 0/1 drawn from hidden 4-wide user and
  movie factors (a sigmoid of their dot product), for the keras-io collaborative-filtering
  model (benchmarks/model_zoo/collab).

The Example protobuf is encoded by hand (a few varints around packed float bytes), so
the runner does not import TensorFlow. A manifest next to each folder says what was
written; matching folders are reused.
"""

from __future__ import annotations

import json
import os

import numpy as np

from elasticdl.data.tfrecord import count_records, write_records


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_example(floats_name: str, floats: np.ndarray, label: int) -> bytes:
    """tf.train.Example{features{feature{floats_name: float_list, "label": int64_list}}}."""
    float_list = _field(1, np.asarray(floats, dtype="<f4").tobytes())  # FloatList.value, packed
    int64_list = _field(1, _varint(int(label)))  # Int64List.value, packed (label >= 0)
    entries = (
        _field(1, _field(1, floats_name.encode()) + _field(2, _field(2, float_list)))  # Feature.float_list
        + _field(1, _field(1, b"label") + _field(2, _field(3, int64_list)))  # Feature.int64_list
    )
    return _field(1, entries)  # Example.features -> Features.feature (map entries)


def encode_ids_example(ids: np.ndarray, label: int) -> bytes:
    """tf.train.Example{features{feature{"ids": int64_list, "label": int64_list}}} (ids >= 0)."""
    ids_list = _field(1, b"".join(_varint(int(i)) for i in ids))  # Int64List.value, packed
    int64_list = _field(1, _varint(int(label)))
    entries = (
        _field(1, _field(1, b"ids") + _field(2, _field(3, ids_list)))
        + _field(1, _field(1, b"label") + _field(2, _field(3, int64_list)))
    )
    return _field(1, entries)


def write_ctr(folder: str, records: int, vocabulary: int, files: int = 2) -> str:
    """The zoo's synthetic click records, ids folded into ``[0, vocabulary)``."""
    from model_zoo.deepctr.generate_data import VOCABULARY, GroundTruth

    seed = 0  # generate_data.py's default: the same records as its training split
    ids, _, labels = GroundTruth(seed).sample(records, np.random.default_rng(seed + 1))
    ids %= vocabulary
    for part, idx in enumerate(np.array_split(np.arange(records), files)):
        write_records(
            os.path.join(folder, f"ctr-{part:03d}.tfrecord"),
            (encode_ids_example(ids[i], labels[i]) for i in idx),
        )
    return (f"model_zoo/deepctr synthetic clicks, {records} records x 8 ids "
            f"({VOCABULARY:,} ids folded modulo {vocabulary:,}; {np.unique(ids).size:,} distinct)")


def write_ratings(folder: str, records: int, users: int, movies: int, files: int = 2, seed: int = 0) -> str:
    """(user, movie) pairs with a 0/1 label from hidden factors: a learnable rating."""
    rng = np.random.default_rng(seed)
    user_factors, movie_factors = rng.normal(size=(users, 4)), rng.normal(size=(movies, 4))
    pairs = np.stack([rng.integers(0, users, records), rng.integers(0, movies, records)], axis=1)
    logits = (user_factors[pairs[:, 0]] * movie_factors[pairs[:, 1]]).sum(axis=1)
    labels = (rng.random(records) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    for part, idx in enumerate(np.array_split(np.arange(records), files)):
        write_records(os.path.join(folder, f"ratings-{part:03d}.tfrecord"),
                      (encode_ids_example(pairs[i], labels[i]) for i in idx))
    return f"synthetic ratings, {records} records of {users:,} users x {movies:,} movies"


def _write(folder: str, prefix: str, name: str, xs: np.ndarray, ys: np.ndarray, files: int = 2) -> None:
    for part, idx in enumerate(np.array_split(np.arange(len(ys)), files)):
        write_records(
            os.path.join(folder, f"{prefix}-{part:03d}.tfrecord"),
            (encode_example(name, xs[i], ys[i]) for i in idx),
        )


def _synthetic(records: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((records, dim), dtype=np.float32)
    w = rng.standard_normal((dim, 10), dtype=np.float32)
    return xs, np.argmax(xs @ w, axis=1)


def write_digits(folder: str, copies: int = 1) -> str:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        xs, ys = _synthetic(1437, 64, seed=2)
        _write(folder, "digits", "image", np.tile(np.clip(np.abs(xs) / 3, 0, 1), (copies, 1)), np.tile(ys, copies),
               files=2 * copies)
        return "synthetic digits-shaped records (scikit-learn is not installed)"
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    x_train, _, y_train, _ = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    _write(folder, "digits", "image", np.tile(x_train, (copies, 1)), np.tile(y_train, copies), files=2 * copies)
    return "scikit-learn digits, the demo's train split" + (f", {copies} times over" if copies > 1 else "")


def prepare(root: str, datasets: dict) -> dict:
    """``datasets``: name -> {"kind": "digits"} (optionally "copies": n), {"kind": "dense",
    "records": n, "dim": d}, {"kind": "ctr", "records": n, "vocabulary": v} or {"kind": "ratings",
    "records": n, "users": u, "movies": m}."""
    out = {}
    for name, want in datasets.items():
        folder = os.path.join(root, name)
        manifest = os.path.join(root, name + ".json")
        if os.path.exists(manifest) and os.path.isdir(folder):
            with open(manifest) as f:
                have = json.load(f)
            if have.get("spec") == want and all(os.path.exists(p) for p in have["files"]):
                out[name] = have
                continue
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):
            os.remove(os.path.join(folder, old))
        if want["kind"] == "digits":
            source = write_digits(folder, want.get("copies", 1))
        elif want["kind"] == "ctr":
            source = write_ctr(folder, want["records"], want["vocabulary"])
        elif want["kind"] == "ratings":
            source = write_ratings(folder, want["records"], want["users"], want["movies"])
        else:
            xs, ys = _synthetic(want["records"], want["dim"], seed=1)
            _write(folder, "dense", "x", xs, ys)
            source = f"synthetic, {want['records']} records x {want['dim']} floats"
        files = sorted(os.path.join(folder, n) for n in os.listdir(folder))
        have = {"spec": want, "dir": folder, "source": source,
                "records": sum(count_records(p) for p in files), "files": files}
        with open(manifest, "w") as f:
            json.dump(have, f)
        out[name] = have
    return out


