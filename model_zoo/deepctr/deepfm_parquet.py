"""DeepFM on the Parquet click data (generate_parquet.py): eight id columns and a multi-hot ``tags`` list.

    python model_zoo/deepctr/generate_parquet.py --output s3://bucket/ctr
    elasticdl train --model_zoo model_zoo --model_def deepctr.deepfm_parquet.custom_model \\
        --training_data s3://bucket/ctr/train --validation_data s3://bucket/ctr/test \\
        --data_reader_params "columns=f0,f1,f2,f3,f4,f5,f6,f7,tags,label;records=columns" \\
        --num_workers 2 --num_ps 2 --minibatch_size 256 --checkpoint_dir s3://bucket/ckpt --output s3://bucket/model

With ``records=columns`` each Parquet row reaches ``dataset_fn`` as a dict of column tensors
(docs/model_zoo.md, "Parquet rows"): an int64 scalar per id column and label, a 1-D int64
tensor of the row's ``tags``. The reader then costs about what pyarrow's read does, where a
serialized tf.train.Example per row would cost several times more. The tags of a row
(0 to MAX_TAGS ids) fill MAX_TAGS slots after the eight fields, unused slots holding PAD_ID:
the model is generate_data's DeepFM over 8 + MAX_TAGS id slots.
"""

import tensorflow as tf
from deepctr.common import eval_metrics_fn, loss  # noqa: F401
from deepctr.deepfm import custom_model as _deepfm
from deepctr.deepfm import optimizer  # noqa: F401
from deepctr.generate_parquet import MAX_TAGS, PAD_ID

from elasticdl import Mode

NUM_FIELDS = 8
SLOTS = NUM_FIELDS + MAX_TAGS
def custom_model(factor_dim=8, hidden_units=16):
    return _deepfm(factor_dim, hidden_units, num_fields=SLOTS)


def dataset_fn(dataset, mode, metadata):
    if metadata.record_format != "parquet" or "tags" not in metadata.column_names:
        raise ValueError(
            "deepfm_parquet reads the columns of the Parquet click data: pass --data_reader_params "
            "\"columns=f0,f1,f2,f3,f4,f5,f6,f7,tags,label;records=columns\""
        )

    def parse(row):
        tags = row["tags"][:MAX_TAGS]
        tags = tf.concat([tags, tf.fill([MAX_TAGS - tf.size(tags)], tf.constant(PAD_ID, tf.int64))], 0)
        ids = tf.stack([row[f"f{f}"] for f in range(NUM_FIELDS)])
        ids = tf.ensure_shape(tf.concat([ids, tags], 0), [SLOTS])
        if mode == Mode.PREDICTION:
            return ids
        return ids, tf.reshape(row["label"], [1])

    dataset = dataset.map(parse)
    if mode == Mode.TRAINING:
        dataset = dataset.shuffle(1024, seed=0)
    return dataset
