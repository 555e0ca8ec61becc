"""Parquet on S3: rows per second one worker's reader gets, against pyarrow reading the same files.

    python -m benchmarks.parquet_s3 --spec '{"rows": 1000000, "files": 2, "row_group_rows": 65536, "reps": 3}'

A moto S3 server on loopback (``moto.server``, a free port) holds the synthetic click data
(model_zoo/deepctr/generate_parquet.py: eight high-cardinality id columns, a multi-hot
``tags`` list, the label). Every repetition reads all of it with each competitor, in an order rotated
between rounds:

- ``elasticdl_reader``: a worker's read path up to what it feeds ``dataset_fn``, with
  ``--data_reader_params records=columns``, from a worker that has not read the files
  before. The master's part is not timed: it cuts the files into tasks of one row group
  from their footers (``make_shards`` over the footers' row counts), and hands a worker a
  file's footer with its first task of the file (this process then forgets the footers, as
  a new worker has none). The tasks come from the master's ledger (``TaskManager``, in
  this process: the RPCs are not the reader's), each with the promise of the next, and the
  worker's loop runs: it keeps the footers handed to it, reads the promised task's records
  in the background (``TaskPrefetch`` over ``load_records``: the row group's column chunks
  in one ranged request, decoded from memory, then Arrow to numpy columns) while this
  task's are cut into the chunks of ``batch_size`` rows (256) that ``BatchStream``
  enqueues into the input pipeline, as numpy arrays. Not measured: the enqueue and the
  per-row work of tf.data and ``dataset_fn`` (the model's).
- ``pyarrow_direct``: ``pyarrow.parquet.read_table`` of each file through pyarrow's own
  S3 client (C++), into Arrow columns; no records. The target's reference.
- ``pyarrow_s3fs``: the same ``read_table`` through s3fs, the client the reader uses (for
  information): the reader over it is what the reader itself costs, it over
  ``pyarrow_direct`` what the HTTP client costs.

All use pyarrow's default thread pool, as large as the machine's cores. A repetition reads
the data ``rounds`` times (5) with each competitor, in rotation, and keeps each one's
median: one read takes a tenth of a
second, and a burst of others' load on the shared machine would otherwise land on one
competitor only. The figure is rows per second; the ratio is the reader's over pyarrow's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.common import REPO, cores, emit


@contextlib.contextmanager
def moto_s3_server():
    """A moto S3 server on a free loopback port; yields its environment (endpoint, test credentials)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The server logs a line per request: to a file, since a pipe nobody reads would fill and
    # stop the server mid-response.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:  # until it answers (it imports for a few seconds first)
            try:  # plain http to the loopback server this function started
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()  # nosec B310
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"moto server did not start: {log.read().decode()[-2000:]}") from None
                time.sleep(0.1)
        yield {
            # moto takes any credentials; a fresh secret lets a test look for it in the logs.
            "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "moto", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(12),
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _elasticdl_reader(files: list[str], row_group_rows: int, batch_size: int) -> tuple[int, float]:
    from elasticdl.data import parquet
    from elasticdl.data.sources import (
        count_records,
        file_footer,
        load_records,
        make_shards,
        remember_file_footer,
    )
    from elasticdl.data.task_prefetch import TaskPrefetch
    from elasticdl.master.task_manager import Task, TaskManager

    # The master cuts the tasks from the files' footers and hands each worker a file's footer
    # with its first task of the file (its part, not timed); this process then forgets them,
    # as a new worker has none.
    ledger = TaskManager(make_shards([(f, count_records(f)) for f in files], row_group_rows))
    footers = {f: file_footer(f) for f in files}
    parquet._footers.clear()
    reads = TaskPrefetch(lambda key: load_records(*key, as_columns=True, batch_size=batch_size))  # the worker's
    given: set[str] = set()
    started = time.perf_counter()
    rows = 0
    while isinstance(task := ledger.get_task(0), Task):  # the worker's task loop, minus the RPCs
        ahead = ledger.read_ahead(0)
        for path in [task.shard.path] + ([ahead.path] if ahead else []):
            if path not in given:  # the footers that came with the task
                given.add(path)
                remember_file_footer(path, *footers[path])
        if ahead is not None:
            reads.start((ahead.path, ahead.start, ahead.end))
        records, _ = reads.take((task.shard.path, task.shard.start, task.shard.end))
        rows += sum(len(chunk[0]) for chunk in records.chunks(batch_size))  # what BatchStream enqueues
        ledger.report(task.task_id, 0)
    elapsed = time.perf_counter() - started
    reads.close()
    return rows, elapsed


def _pyarrow_direct(files: list[str], env: dict) -> tuple[int, float]:
    import pyarrow.fs
    import pyarrow.parquet as pq

    started = time.perf_counter()
    s3 = pyarrow.fs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], access_key=env["AWS_ACCESS_KEY_ID"],
                                 secret_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_DEFAULT_REGION"])
    rows = sum(pq.read_table(f.split("://", 1)[1], filesystem=s3).num_rows for f in files)
    return rows, time.perf_counter() - started


def _pyarrow_s3fs(files: list[str]) -> tuple[int, float]:
    import pyarrow.parquet as pq

    from elasticdl import fs

    started = time.perf_counter()
    client = fs.filesystem(files[0])
    rows = sum(pq.read_table(f, filesystem=client).num_rows for f in files)
    return rows, time.perf_counter() - started


def run(spec: dict) -> dict:
    import pyarrow

    # A benchmark child runs with OMP_NUM_THREADS=1 (for TensorFlow's sake, benchmarks/common.py),
    # which Arrow reads as its CPU pool's size: pyarrow reading directly gets every core, as it
    # does for a user, and so does the reader (its read-ahead threads).
    pyarrow.set_cpu_count(cores())
    sys.path.insert(0, os.path.join(REPO, "model_zoo"))
    from deepctr.generate_parquet import generate

    with moto_s3_server() as env:
        os.environ.update(env)
        import s3fs

        s3fs.S3FileSystem(client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}).mkdir("bench")
        generate("s3://bench/ctr", train_rows=spec["rows"], test_rows=1000, train_files=spec["files"],
                 row_group_rows=spec["row_group_rows"])
        from elasticdl.data.sources import resolve_data_files

        files = resolve_data_files("s3://bench/ctr/train")
        runs = []
        for rep in range(spec["reps"]):
            reads = {
                "elasticdl_reader": lambda: _elasticdl_reader(files, spec["row_group_rows"], spec.get("batch_size", 256)),
                "pyarrow_direct": lambda: _pyarrow_direct(files, env),
                "pyarrow_s3fs": lambda: _pyarrow_s3fs(files),
            }
            rates: dict[str, list[float]] = {name: [] for name in reads}
            for round_ in range(spec.get("rounds", 5)):  # rotating: a burst of load hits all alike
                names = list(reads)
                order = names[(rep + round_) % len(names):] + names[:(rep + round_) % len(names)]
                for name in order:
                    rows, seconds = reads[name]()
                    if rows != spec["rows"]:
                        raise RuntimeError(f"{name} read {rows} rows of {spec['rows']}")
                    rates[name].append(rows / seconds)
            result = {name: statistics.median(values) for name, values in rates.items()}
            runs.append(result)
            sys.stderr.write(f"rep {rep + 1}: {json.dumps(result)}\n")
        return {"runs": runs, "bytes": sum(s3fs.S3FileSystem().size(f) for f in files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default='{"rows": 200000, "files": 2, "row_group_rows": 16384, "reps": 1}')
    emit(run(json.loads(parser.parse_args().spec)))


if __name__ == "__main__":
    main()
