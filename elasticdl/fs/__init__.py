"""Paths on a local disk or a remote filesystem (``s3://``, ``gs://``, ``hdfs://``), through fsspec.

Every file the job reads or writes (data, checkpoints, ``--output``, prediction outputs)
goes through here, so a path is a path wherever it lives. Local paths keep using the
operating system directly (no fsspec in the way, the same fsync-and-rename writes as
before); a path with a scheme goes to the fsspec filesystem of that scheme, which is
imported only then (s3fs for ``s3://``, gcsfs for ``gs://``, pyarrow for ``hdfs://``).

Credentials and endpoints come from the standard places and never from a flag:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (or a profile, or an instance role) and
``AWS_ENDPOINT_URL`` for S3-compatible stores (MinIO, moto); ``GOOGLE_APPLICATION_CREDENTIALS``
for GCS. On Kubernetes, ``--envs`` carries them to every pod through a Secret.

Object stores have no rename, so :func:`write_atomically` uploads the whole object in one
put and then commits a marker object (``<name>.committed``) next to it; readers of
checkpoints trust a remote file only once :func:`committed` sees its marker. A reader that
streams (:func:`open` for reading) asks for large blocks with read-ahead, so sequential
records come from memory while the next block is on its way.
"""

from __future__ import annotations

import builtins
import glob as _glob
import io
import os
import secrets
import shutil
from collections.abc import Callable
from typing import IO, Any

from elasticdl.errors import UserError

# Sequential readers fetch this much per request; the read-ahead cache keeps one block ahead.
READ_BLOCK = 8 << 20
_MARKER = ".committed"
_LOCAL = ("", "file", "local")


class StorageError(UserError, OSError):
    """A remote path cannot be used: no credentials, no such bucket, no fsspec backend."""


def scheme(path: str) -> str:
    """``"s3"`` for ``s3://b/k``; ``""`` for a local path."""
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep and head.isidentifier() else ""


def is_remote(path: str) -> bool:
    return scheme(path) not in _LOCAL


def _strip_local(path: str) -> str:
    return str(path)[len("file://"):] if scheme(path) == "file" else str(path)


def filesystem(path: str):
    """The fsspec filesystem serving a remote ``path``."""
    proto = scheme(path)
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{path}: remote paths need fsspec: pip install fsspec s3fs") from None
    options: dict[str, Any] = {}
    if proto in ("s3", "s3a"):
        # botocore reads AWS_ENDPOINT_URL itself only in recent versions; s3fs may pin an older one.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        return fsspec.filesystem(proto, **options)
    except ImportError as err:
        package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}.get(proto, str(err.name or "its package"))
        raise StorageError(f"{path}: {proto}:// paths need the {package} package: pip install {package}") from None
    except ValueError as err:
        raise StorageError(f"{path}: no filesystem for {proto}:// ({err})") from None


def explain(path: str, err: BaseException) -> StorageError | None:
    """A StorageError naming the problem with ``path`` and its fix, for the errors users cause."""
    name = type(err).__name__
    text = str(err)
    if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in text:
        return StorageError(
            f"{path}: no credentials for {scheme(path)}://. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(and AWS_ENDPOINT_URL for MinIO or another S3-compatible store) in the environment, or give "
            "the machine an instance role; on Kubernetes pass them with --envs, which goes through a Secret."
        )
    if "NoSuchBucket" in text or "specified bucket does not exist" in text:
        return StorageError(f"{path}: bucket {bucket(path)!r} does not exist. Create it or fix the path.")
    if name in ("ClientError", "PermissionError") and ("AccessDenied" in text or "Forbidden" in text or "403" in text):
        return StorageError(f"{path}: access denied: the credentials in the environment may not use this path.")
    if name == "EndpointConnectionError" or "Could not connect to the endpoint" in text:
        return StorageError(f"{path}: cannot reach the endpoint ({text}). Check AWS_ENDPOINT_URL.")
    return None


def bucket(path: str) -> str:
    return str(path).partition("://")[2].split("/", 1)[0]


def _call(path: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except StorageError:
        raise
    except Exception as err:
        better = explain(path, err)
        if better is None:
            raise
        raise better from err


def check_bucket(path: str) -> None:
    """StorageError unless the bucket (or root) of a remote ``path`` exists and the credentials work."""
    if not is_remote(path):
        return
    fs = filesystem(path)
    root = f"{scheme(path)}://{bucket(path)}"
    if not _call(path, lambda: fs.exists(root)):
        raise StorageError(f"{path}: bucket {bucket(path)!r} does not exist (or these credentials cannot see "
                           "it). Create it or fix the path.")


def open(path: str, mode: str = "rb", **kwargs) -> IO:  # noqa: A001  (mirrors builtins.open)
    """A file object; remote reads stream in READ_BLOCK blocks with read-ahead."""
    if not is_remote(path):
        return builtins.open(_strip_local(path), mode, **kwargs)
    fs = filesystem(path)
    if "r" in mode:
        kwargs.setdefault("block_size", READ_BLOCK)
        kwargs.setdefault("cache_type", "readahead")
    return _call(path, lambda: fs.open(path, mode, **kwargs))


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(_strip_local(path))
    return _call(path, lambda: filesystem(path).exists(path))


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(_strip_local(path))
    return _call(path, lambda: filesystem(path).isfile(path))


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(_strip_local(path))
    return _call(path, lambda: filesystem(path).isdir(path))


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(_strip_local(path))
    return int(_call(path, lambda: filesystem(path).size(path)))


def join(path: str, *parts: str) -> str:
    if not is_remote(path):
        return os.path.join(path, *parts)
    return "/".join([str(path).rstrip("/"), *(p.strip("/") for p in parts)])


def basename(path: str) -> str:
    return os.path.basename(str(path).rstrip("/")) if is_remote(path) else os.path.basename(path)


def listdir(path: str) -> list[str]:
    """Names (not paths) of the entries directly inside directory ``path``."""
    if not is_remote(path):
        return os.listdir(_strip_local(path))
    entries = _call(path, lambda: filesystem(path).ls(path, detail=False, refresh=True))
    return [basename(e) for e in entries]


def files_in(directory: str) -> list[str]:
    """Regular, non-hidden files directly inside ``directory``, sorted, as full paths."""
    if not is_remote(directory):
        names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
        return [p for p in (os.path.join(directory, n) for n in names) if os.path.isfile(p)]
    fs = filesystem(directory)
    proto = scheme(directory)
    entries = _call(directory, lambda: fs.ls(directory, detail=True, refresh=True))
    found = [e["name"] for e in entries if e.get("type") == "file" and not basename(e["name"]).startswith(".")]
    return sorted(_with_scheme(proto, n) for n in found if not n.endswith(_MARKER))


def _with_scheme(proto: str, name: str) -> str:
    return name if "://" in name else f"{proto}://{name}"


def has_magic(path: str) -> bool:
    return _glob.has_magic(path)


def glob(pattern: str) -> list[str]:
    """Paths matching ``pattern``, sorted (a remote pattern keeps its scheme)."""
    if not is_remote(pattern):
        return sorted(_glob.glob(pattern))
    fs = filesystem(pattern)
    return sorted(_with_scheme(scheme(pattern), n) for n in _call(pattern, lambda: fs.glob(pattern)))


def makedirs(path: str) -> None:
    """Create a directory (object stores have none: nothing to do there)."""
    if not is_remote(path):
        os.makedirs(_strip_local(path), exist_ok=True)


def rmtree(path: str) -> None:
    """Remove a directory and everything under it; a missing one is fine."""
    if not is_remote(path):
        shutil.rmtree(_strip_local(path), ignore_errors=True)
        return
    fs = filesystem(path)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def remove(path: str) -> None:
    """Remove a file (and, remote, its commit marker first, so it never counts half-removed)."""
    if not is_remote(path):
        os.unlink(_strip_local(path))
        return
    fs = filesystem(path)
    for name in (path + _MARKER, path):
        try:
            _call(path, lambda n=name: fs.rm_file(n))
        except FileNotFoundError:
            pass


def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        with builtins.open(_strip_local(path), "rb") as f:
            return f.read()
    return _call(path, lambda: filesystem(path).cat_file(path))


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file (fewer where the file ends first): remote, one ranged request.

    On S3 the request goes over a presigned URL (elasticdl/fs/presigned.py) when it can, which
    costs the reader's CPU a fraction of an s3fs request; s3fs serves it otherwise.
    """
    if not is_remote(path):
        with builtins.open(_strip_local(path), "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs = filesystem(path)
    if scheme(path) in ("s3", "s3a"):
        data = _presigned(fs).read(path, start, end)
        if data is not None:
            return data
    return _call(path, lambda: fs.cat_file(path, start=start, end=end))


def read_tail(path: str, length: int) -> tuple[int, bytes]:
    """(the file's size, its last ``length`` bytes, or all of a shorter file).

    On S3 one request over a presigned URL (a suffix range: the answer names the size); else
    the size, then a ranged read.
    """
    if not is_remote(path):
        with builtins.open(_strip_local(path), "rb") as f:
            total = f.seek(0, os.SEEK_END)
            f.seek(max(0, total - length))
            return total, f.read()
    fs = filesystem(path)
    if scheme(path) in ("s3", "s3a"):
        found = _presigned(fs).tail(path, length)
        if found is not None:
            return found
    total = size(path)
    return total, _call(path, lambda: fs.cat_file(path, start=max(0, total - length), end=total))


_PRESIGNED: dict[int, Any] = {}  # id(s3fs filesystem) -> PresignedRanges (fsspec caches the filesystems)


def _presigned(fs):
    from elasticdl.fs.presigned import PresignedRanges

    ranges = _PRESIGNED.get(id(fs))
    if ranges is None or ranges.filesystem is not fs:
        ranges = _PRESIGNED[id(fs)] = PresignedRanges(fs)
    return ranges


def write_atomically(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` to ``path`` so that a reader sees the whole new file or none of it.

    Local: a hidden temp file next to ``path``, fsynced, renamed over it, the directory
    fsynced (a crash or a full disk leaves no partial file). Remote: ``write`` fills memory,
    the object goes up in one put (a writer killed mid-way leaves no object), and a marker
    ``<path>.committed`` is written after it: stores that show a file while it is written
    (HDFS) never expose a partial one to :func:`committed`.
    """
    if is_remote(path):
        buffer = io.BytesIO()
        write(buffer)
        fs = filesystem(path)
        _call(path, lambda: fs.pipe_file(path, buffer.getvalue()))
        _call(path, lambda: fs.pipe_file(path + _MARKER, b""))
        return
    path = _strip_local(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory or ".")


def fsync_dir(directory: str) -> None:
    """Make a directory's new entries durable (local only: object stores have no directories)."""
    if is_remote(directory):
        return
    fd = os.open(_strip_local(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed(path: str) -> bool:
    """Is the file at ``path`` whole? Local files are (see write_atomically); remote ones once
    their marker is there."""
    return not is_remote(path) or exists(path + _MARKER)


def put_dir(local: str, remote: str) -> None:
    """Upload the tree under ``local`` to ``remote`` (replacing it), e.g. a SavedModel."""
    fs = filesystem(remote)
    rmtree(remote)
    for root, _, names in os.walk(local):
        for name in names:
            source = os.path.join(root, name)
            target = join(remote, os.path.relpath(source, local).replace(os.sep, "/"))
            _call(remote, lambda s=source, t=target: fs.put_file(s, t))
