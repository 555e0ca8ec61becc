"""Write the digits (1,797 8x8 images) as TFRecord train/test files.

    python model_zoo/digits/prepare_data.py --output data/digits

Each record is a tf.train.Example with ``image`` (64 floats in [0, 1]) and ``label``
(int64). The split is stratified with a fixed seed, so every run writes the same files.

digits.csv.gz beside this file is scikit-learn's copy of the UCI ML hand-written digits test
set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), 64 pixels (0..16) and the label per row. It is
read here, and split as scikit-learn's ``train_test_split(..., stratify=...)`` splits it, so that
the demo needs neither scikit-learn nor SciPy (`make demo` installs only ElasticDL and
TensorFlow); tests/test_install.py checks both against scikit-learn.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def _example(image: np.ndarray, label: int) -> bytes:
    from elasticdl.model.tf_runtime import load_tensorflow

    tf = load_tensorflow()  # without TensorFlow's start-up banner

    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.tolist())),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
        )
    ).SerializeToString()


DIGITS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.csv.gz")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels as float64, labels), as scikit-learn's ``load_digits()`` returns data and target."""
    table = np.loadtxt(DIGITS_CSV, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Draws per class: scikit-learn's ``_approximate_mode``, ties broken by the same rng calls."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need_to_add <= 0:
            break
        (inds,) = np.where(remainder == value)
        add_now = min(len(inds), need_to_add)
        floored[rng.choice(inds, size=add_now, replace=False)] += 1
        need_to_add -= add_now
    return floored.astype(int)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): ``train_test_split(test_size=test_fraction, random_state=seed,
    stratify=labels)``'s, reproduced (its StratifiedShuffleSplit) so that the files stay the same."""
    n_test = int(np.ceil(test_fraction * len(labels)))
    n_train = int(np.floor((1 - test_fraction) * len(labels)))
    _, y_indices, class_counts = np.unique(labels, return_inverse=True, return_counts=True)
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for i, indices in enumerate(class_indices):
        shuffled = indices.take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(shuffled[: n_i[i]])
        test.extend(shuffled[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def prepare(output: str, test_fraction: float = 0.2, train_files: int = 2, seed: int = 0) -> dict:
    from elasticdl.data.tfrecord import write_records

    data, target = load_digits()
    images = (data / 16.0).astype(np.float32)
    train, test = stratified_split(target, test_fraction, seed)
    x_train, x_test, y_train, y_test = images[train], images[test], target[train], target[test]
    counts = {}
    for split, xs, ys, parts in (("train", x_train, y_train, train_files), ("test", x_test, y_test, 1)):
        folder = os.path.join(output, split)
        os.makedirs(folder, exist_ok=True)
        for part, idx in enumerate(np.array_split(np.arange(len(ys)), parts)):
            path = os.path.join(folder, f"digits-{part:03d}.tfrecord")
            write_records(path, (_example(xs[i], ys[i]) for i in idx))
        counts[split] = len(ys)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/digits", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = prepare(args.output, seed=args.seed)
    print(f"wrote {counts['train']} training and {counts['test']} test records to {args.output}/{{train,test}}")


if __name__ == "__main__":
    main()
