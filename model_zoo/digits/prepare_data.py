"""Write scikit-learn's bundled digits (1,797 8x8 images) as TFRecord train/test files.

    python model_zoo/digits/prepare_data.py --output data/digits

Each record is a tf.train.Example with ``image`` (64 floats in [0, 1]) and ``label``
(int64). The split is stratified with a fixed seed, so every run writes the same files.
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


def prepare(output: str, test_fraction: float = 0.2, train_files: int = 2, seed: int = 0) -> dict:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from elasticdl.data.tfrecord import write_records

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target
    )
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
