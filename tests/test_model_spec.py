"""Model-zoo contract checks: load_model_spec and preflight.check_job messages."""

from __future__ import annotations

import itertools
import os
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf
from zoo_helpers import restore_import_state

from elasticdl.config import ConfigError, JobConfig
from elasticdl.data.tfrecord import write_records
from elasticdl.master.preflight import check_job
from elasticdl.model.spec import ModelSpecError, load_model_spec

PROLOGUE = """\
import keras
import tensorflow as tf

from elasticdl.python.common.constants import Mode

_FEATURES = {
    "x": tf.io.FixedLenFeature([4], tf.float32),
    "y": tf.io.FixedLenFeature([1], tf.int64),
}
"""

# A small working model-zoo module, one section per contract function.
SECTIONS = {
    "custom_model": """
        def custom_model(units=3):
            inputs = keras.Input(shape=(4,), name="x")
            outputs = keras.layers.Dense(units, name="logits")(inputs)
            return keras.Model(inputs, outputs)
    """,
    "loss": """
        def loss(labels, predictions):
            labels = tf.reshape(labels, [-1])
            return tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
            )
    """,
    "optimizer": """
        def optimizer(lr=0.1):
            return keras.optimizers.SGD(learning_rate=lr)
    """,
    "dataset_fn": """
        def dataset_fn(dataset, mode, metadata):
            def parse(record):
                example = tf.io.parse_single_example(record, _FEATURES)
                if mode == Mode.PREDICTION:
                    return example["x"]
                return example["x"], example["y"]
            return dataset.map(parse)
    """,
    "eval_metrics_fn": """
        def eval_metrics_fn():
            return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
    """,
}

_counter = itertools.count()


_restore_import_state = restore_import_state("tmpzoo_")


def write_module(tmp_path, text: str, module: str = "model") -> tuple[str, str, str]:
    """Write ``text`` as ``<zoo>/<unique pkg>/<module>.py``; (zoo, model_def, module_path)."""
    package = f"tmpzoo_{os.getpid()}_{next(_counter)}"
    zoo = tmp_path / "zoo"
    (zoo / package).mkdir(parents=True)
    (zoo / package / "__init__.py").write_text("")
    path = zoo / package / f"{module}.py"
    path.write_text(text)
    return str(zoo), f"{package}.{module}.custom_model", os.path.join(str(zoo), package, f"{module}.py")


def model_text(drop=(), **replace: str) -> str:
    parts = [PROLOGUE]
    for name, source in SECTIONS.items():
        if name in drop:
            continue
        parts.append(textwrap.dedent(replace.pop(name, source)))
    parts.extend(textwrap.dedent(source) for source in replace.values())  # extra definitions
    return "\n".join(parts)


def write_model(tmp_path, drop=(), **replace: str):
    return write_module(tmp_path, model_text(drop, **replace))


def load_error(tmp_path, drop=(), **replace: str) -> tuple[str, str]:
    zoo, model_def, path = write_model(tmp_path, drop, **replace)
    with pytest.raises(ModelSpecError) as info:
        load_model_spec(zoo, model_def)
    return str(info.value), path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    def example(i: int) -> bytes:
        return tf.train.Example(
            features=tf.train.Features(
                feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 10, 1.0, -1.0, 0.5])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
                }
            )
        ).SerializeToString()

    path = tmp_path_factory.mktemp("data") / "train.tfrecord"
    assert write_records(path, (example(i) for i in range(12))) == 12
    return str(path)


def job(tmp_path, data_file, drop=(), **replace: str) -> JobConfig:
    zoo, model_def, _ = write_model(tmp_path, drop, **replace)
    return JobConfig.from_flags(model_zoo=zoo, model_def=model_def, training_data=data_file, minibatch_size=4)


def check_error(tmp_path, data_file, drop=(), **replace: str) -> tuple[str, str]:
    config = job(tmp_path, data_file, drop, **replace)
    with pytest.raises(ModelSpecError) as info:
        check_job(config)
    return str(info.value), os.path.join(config.training.model_zoo, *config.training.model_def.split(".")[:-1]) + ".py"


# ---------------------------------------------------------------- load_model_spec


def test_complete_module_loads(tmp_path):
    zoo, model_def, path = write_model(tmp_path)
    spec = load_model_spec(zoo, model_def)
    assert spec.module_path == path and spec.model_name == "custom_model"
    module = sys.modules[model_def.rpartition(".")[0]]
    assert spec.model_fn is module.custom_model
    assert spec.loss.__wrapped__ is module.loss and spec.optimizer is module.optimizer
    assert spec.dataset_fn is module.dataset_fn and spec.eval_metrics_fn is module.eval_metrics_fn
    assert spec.callbacks is None and spec.learning_rate_scheduler is None


@pytest.mark.parametrize(
    "name, signature",
    [
        ("loss", "loss(labels, predictions) -> scalar tensor"),
        ("optimizer", "optimizer(lr=0.1) -> a keras.optimizers.Optimizer"),
        ("dataset_fn", "dataset_fn(dataset, mode, metadata) -> tf.data.Dataset of (features, labels)"),
    ],
)
def test_missing_required_function(tmp_path, name, signature):
    message, path = load_error(tmp_path, drop=(name,))
    assert message.startswith(path + ":")
    assert f"missing `{name}`" in message
    assert signature in message


def test_missing_model_function(tmp_path):
    message, path = load_error(tmp_path, drop=("custom_model",))
    assert path in message and "missing `custom_model` (from --model_def)" in message
    assert "keras.Model" in message


def test_feed_accepted_instead_of_dataset_fn(tmp_path):
    feed = textwrap.dedent(SECTIONS["dataset_fn"]).replace("def dataset_fn(", "def feed(")
    zoo, model_def, _ = write_model(tmp_path, drop=("dataset_fn",), feed=feed)
    spec = load_model_spec(zoo, model_def)
    assert spec.dataset_fn.__name__ == "feed"


@pytest.mark.parametrize(
    "source",
    [
        "def loss(labels):\n    return labels\n",
        "def loss(labels, predictions, weights):\n    return labels\n",
    ],
)
def test_loss_with_wrong_arity(tmp_path, source):
    message, path = load_error(tmp_path, loss=source)
    assert path in message
    assert "`loss(" in message and "has the wrong parameters" in message
    assert "Expected loss(labels, predictions) -> scalar tensor" in message


def test_flexible_signatures_accepted(tmp_path):
    zoo, model_def, _ = write_model(
        tmp_path,
        loss="def loss(*args, **kwargs):\n    return args[0]\n",
        optimizer="def optimizer(lr=0.1, **kw):\n    return keras.optimizers.SGD(lr)\n",
        dataset_fn="def dataset_fn(dataset, mode, metadata=None, extra=1):\n    return dataset\n",
    )
    load_model_spec(zoo, model_def)


def test_optimizer_with_required_argument(tmp_path):
    message, _ = load_error(tmp_path, optimizer="def optimizer(lr):\n    return None\n")
    assert "`optimizer(lr)` has the wrong parameters" in message


def test_optional_functions_checked(tmp_path):
    message, path = load_error(tmp_path, callbacks="callbacks = [1, 2]\n")
    assert message == f"{path}: `callbacks` must be callable. Expected callbacks() -> [keras.callbacks.Callback, ...]."
    message, _ = load_error(tmp_path / "b", learning_rate_scheduler="def learning_rate_scheduler():\n    return 0.1\n")
    assert "learning_rate_scheduler(model_version) -> float" in message
    message, _ = load_error(tmp_path / "c", PredictionOutputsProcessor="class PredictionOutputsProcessor:\n    pass\n")
    assert "process(self, predictions, worker_id)" in message


def test_module_that_raises_on_import(tmp_path):
    zoo, model_def, path = write_module(tmp_path, PROLOGUE + "\nraise RuntimeError('no GPU here, sorry')\n")
    with pytest.raises(ModelSpecError) as info:
        load_model_spec(zoo, model_def)
    message = str(info.value)
    assert message.startswith(path + ":")
    assert "importing the module failed: RuntimeError: no GPU here, sorry" in message


def test_module_with_syntax_error(tmp_path):
    zoo, model_def, path = write_module(tmp_path, "def custom_model(:\n    pass\n")
    with pytest.raises(ModelSpecError, match="importing the module failed: SyntaxError"):
        load_model_spec(zoo, model_def)


def test_model_def_errors(tmp_path):
    zoo, model_def, _ = write_model(tmp_path)
    with pytest.raises(ModelSpecError, match="must be pkg.module.name"):
        load_model_spec(zoo, "custom_model")
    package = model_def.split(".")[0]
    with pytest.raises(ModelSpecError, match=r"nope\.py, which does not exist"):
        load_model_spec(zoo, f"{package}.nope.custom_model")


def test_mode_alias():
    from elasticdl import Mode as TopLevelMode
    from elasticdl.python.common.constants import Mode

    assert Mode is TopLevelMode
    assert Mode.TRAINING == "training"
    assert Mode.EVALUATION == "evaluation" and Mode.PREDICTION == "prediction"


# ---------------------------------------------------------------- check_job


def test_check_job_passes_a_good_model(tmp_path, data_file):
    checked = check_job(job(tmp_path, data_file))
    assert checked.files == [(data_file, 12)]
    assert checked.optimizer_spec.name == "SGD"
    assert checked.optimizer_spec.config["learning_rate"] == pytest.approx(0.1)
    assert tuple(checked.sample_features.shape) == (4, 4)


def test_custom_model_returning_non_keras(tmp_path, data_file):
    message, path = check_error(
        tmp_path, data_file, custom_model="def custom_model():\n    return lambda x: x\n"
    )
    assert path in message
    assert "custom_model() must return a keras.Model" in message
    assert "Received: function" in message


def test_unsupported_optimizer(tmp_path, data_file):
    message, path = check_error(
        tmp_path, data_file, optimizer="def optimizer(lr=0.1):\n    return keras.optimizers.Nadam(lr)\n"
    )
    assert path in message
    assert "keras.optimizers.Nadam" in message
    assert "supports SGD, Adam, AdamW, Adagrad, RMSprop" in message


def test_per_example_loss_is_reduced_by_its_mean_with_a_warning(tmp_path, data_file, caplog):
    loss = """
        def loss(labels, predictions):
            labels = tf.reshape(labels, [-1])
            return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    """
    config = job(tmp_path, data_file, loss=loss)
    with caplog.at_level("WARNING"):
        checked = check_job(config)
    warnings = [r.getMessage() for r in caplog.records if "not a scalar" in r.getMessage()]
    assert len(warnings) == 1 and "(4,)" in warnings[0] and "its mean" in warnings[0]
    labels, predictions = tf.constant([0, 1]), tf.constant([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    per_example = checked.spec.loss.__wrapped__(labels, predictions)
    assert float(checked.spec.loss(labels, predictions)) == pytest.approx(float(tf.reduce_mean(per_example)))


def test_loss_that_raises(tmp_path, data_file):
    message, _ = check_error(
        tmp_path, data_file, loss="def loss(labels, predictions):\n    raise ValueError('bad labels')\n"
    )
    assert "loss(labels, predictions) failed: bad labels" in message


@pytest.mark.parametrize("returned", ["[keras.metrics.Mean()]", "{}", "None"])
def test_eval_metrics_fn_must_return_a_dict(tmp_path, data_file, returned):
    message, path = check_error(
        tmp_path, data_file, eval_metrics_fn=f"def eval_metrics_fn():\n    return {returned}\n"
    )
    assert path in message
    assert "eval_metrics_fn() must return a non-empty dict" in message


def test_eval_metric_that_is_not_a_metric(tmp_path, data_file):
    message, _ = check_error(
        tmp_path, data_file, eval_metrics_fn="def eval_metrics_fn():\n    return {'acc': 3}\n"
    )
    assert "eval_metrics_fn()['acc'] must be a keras.metrics.Metric" in message


def test_dataset_fn_must_return_a_dataset(tmp_path, data_file):
    message, path = check_error(
        tmp_path, data_file, dataset_fn="def dataset_fn(dataset, mode, metadata):\n    return [1, 2]\n"
    )
    assert path in message and "dataset_fn must return a tf.data.Dataset" in message


def test_dataset_fn_must_yield_pairs_in_training(tmp_path, data_file):
    dataset_fn = """
        def dataset_fn(dataset, mode, metadata):
            return dataset.map(lambda r: tf.io.parse_single_example(r, _FEATURES)["x"])
    """
    message, _ = check_error(tmp_path, data_file, dataset_fn=dataset_fn)
    assert "must yield (features, labels) pairs" in message


# ---------------------------------------------------------------- evaluation and prediction input


def test_metric_function_that_raises_fails_at_submit(tmp_path, data_file):
    metrics = """
        def _broken(labels, predictions):
            raise RuntimeError("metric exploded")

        def eval_metrics_fn():
            return {"broken": _broken}
    """
    message, path = check_error(tmp_path, data_file, eval_metrics_fn=metrics)
    assert path in message
    assert "eval_metrics_fn()['broken'] failed on a batch" in message and "metric exploded" in message


def test_evaluate_needs_eval_metrics_fn(tmp_path, data_file):
    config = job(tmp_path, data_file, drop=("eval_metrics_fn",))
    config = config.replace(validation_data=data_file, checkpoint_dir_for_init=str(tmp_path))
    with pytest.raises(ModelSpecError, match="`elasticdl evaluate` needs eval_metrics_fn"):
        check_job(config, "evaluate")


def test_missing_validation_data_is_a_clear_error(tmp_path, data_file):
    from elasticdl.data.errors import NoDataFilesError

    config = job(tmp_path, data_file).replace(validation_data=str(tmp_path / "nowhere"))
    with pytest.raises(NoDataFilesError, match="nowhere"):
        check_job(config)
    with pytest.raises(ConfigError, match="--validation_data is required for `elasticdl evaluate`"):
        config.replace(validation_data="").validate("evaluate")
