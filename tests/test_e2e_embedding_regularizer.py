"""End to end: the keras-io collaborative-filtering model (plain Keras Embeddings with an L2
regularizer, unedited model code) trains on 2 workers + 2 PS with its tables on the PS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(REPO, "benchmarks", "model_zoo")  # the keras-io model, as the benchmark runs it
USERS, MOVIES = 500, 200


def test_collaborative_filtering_with_l2_embeddings_trains_with_tables_on_the_ps(tmp_path):
    from benchmarks.data import write_ratings

    os.makedirs(tmp_path / "ratings")
    write_ratings(str(tmp_path / "ratings"), records=4000, users=USERS, movies=MOVIES)
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", ZOO,
         "--model_def", "collab.recommender.custom_model",
         "--model_params", f"num_users={USERS};num_movies={MOVIES};embedding_size=50",
         "--training_data", str(tmp_path / "ratings"),
         "--num_workers", "2", "--num_ps", "2", "--minibatch_size", "64", "--num_epochs", "3",
         "--optimizer", "fast_optimizer",
         # The model's tables are 0.1 MiB and smaller: swap them all, as 50,000 users would be.
         "--embedding_swap_threshold_mb", "0", "--job_name", "collab"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["status"] == "succeeded" and report["records_trained"] == 3 * 4000
    print(f"collaborative filtering: final loss {report['final_loss']:.4f}; tables {report['embedding_tables']}")
    assert report["final_loss"] < 0.65  # it learns: predicting 0.5 everywhere costs ln 2 = 0.693
    tables = report["embedding_tables"]
    for name, vocab in (("users", USERS), ("movies", MOVIES)):
        table = tables[f"recommender/{name}/embeddings"]
        assert 0.9 * vocab < table["rows"] <= vocab  # rows of the ids seen, on the PS
    log = result.stderr
    assert "keras Embedding 'users' (500 x 50, 0.10 MiB) is larger than" in log
    assert "regularizer l2=1e-06 on the rows each batch touches" in log
    assert "stays a dense variable" not in log
