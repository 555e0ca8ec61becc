"""Ranged reads of S3 objects over presigned URLs: a row group's bytes in one plain HTTP GET.

A ``GetObject`` through s3fs builds, signs and parses every request in botocore's Python
(user agent, endpoint rules, header dicts, date parsing): a few milliseconds of the worker's
CPU per request, against a fraction of that for the bytes themselves. A worker reading
Parquet makes one request per row group, task after task, so that CPU competes with the
conversion and the training. Here the object's URL is presigned once (by s3fs, with the
credentials from the standard places; locally, no request) and reused for a while; each
range is then one ``GET`` with a ``Range`` header on a kept-alive connection, whose body the
socket reads without holding the GIL.

This is only a faster way to the same bytes. Whatever it cannot vouch for goes back to the
caller as ``None``, and the caller reads through s3fs, which gives the same bytes or the
error that names the problem (no such bucket, no credentials, access denied): any answer but
the whole range (an expired or refused signature, server-side encryption with a customer
key, requester-pays buckets, a server error), a connection that fails, or an HTTP proxy in
the environment (botocore's proxy settings are not repeated here).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable

logger = logging.getLogger(__name__)

# A URL is signed for SIGNED_SECONDS and reused for half of that: a request never carries an
# expired signature, and an object read task after task is signed about once an hour.
SIGNED_SECONDS = 7200
_REUSE_SECONDS = SIGNED_SECONDS / 2
_TIMEOUT_SECONDS = 60.0
_URLS_KEPT = 1024


class PresignedRanges:
    """Byte ranges of the objects of one s3fs filesystem; thread-safe."""

    def __init__(self, filesystem, clock: Callable[[], float] = time.monotonic):
        self.filesystem = filesystem
        self._clock = clock
        self._lock = threading.Lock()
        self._urls: dict[str, tuple[str, float]] = {}  # path -> (URL, signed at)
        self._refused: set[str] = set()  # buckets whose presigned reads failed: s3fs only from then on
        self._pools: dict[tuple[str, str], object] = {}  # (scheme, host) -> urllib3 connection pool

    def read(self, path: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the object at ``path``, or None: read it through s3fs instead."""
        if end <= start:
            return None
        answer = self._get(path, f"bytes={start}-{end - 1}")
        if answer is None:
            return None
        status, body, _ = answer
        if len(body) == end - start and (status == 206 or start == 0):
            return body
        return None

    def tail(self, path: str, length: int) -> tuple[int, bytes] | None:
        """(the object's size, its last ``length`` bytes), or None: ask s3fs instead."""
        answer = self._get(path, f"bytes=-{length}")
        if answer is None:
            return None
        status, body, content_range = answer
        if status == 200:  # the whole object (a server that takes no suffix range, or a short object)
            return len(body), body[-length:]
        total = content_range.rpartition("/")[2]  # "bytes 100-199/200"
        if not total.isdigit() or len(body) > length:
            return None
        return int(total), body

    def _get(self, path: str, byte_range: str) -> tuple[int, bytes, str] | None:
        """(status, body, Content-Range) of a ranged GET of ``path``; None when it did not serve."""
        bucket = path.partition("://")[2].split("/", 1)[0]
        if bucket in self._refused:
            return None
        url = self._url(path)
        if url is None:
            return None
        import urllib3

        scheme, _, rest = url.partition("://")
        host, _, query = rest.partition("/")
        try:
            response = self._connections(url, scheme, host).urlopen(
                "GET", "/" + query, headers={"Range": byte_range}, preload_content=False, retries=False,
                timeout=urllib3.Timeout(connect=_TIMEOUT_SECONDS, read=_TIMEOUT_SECONDS),
            )
            # The stored bytes, as ranges count them (an object stored with a Content-Encoding too).
            body = response.read(decode_content=False)
            response.release_conn()
        except urllib3.exceptions.HTTPError as err:  # s3fs retries, and names what is wrong
            logger.debug("%s: presigned read failed (%s); reading through s3fs", path, err)
            return None
        if response.status in (200, 206):
            return response.status, body, response.headers.get("Content-Range", "")
        if response.status in (400, 401, 403, 405, 501):  # this bucket does not take them: stop trying
            with self._lock:
                if bucket not in self._refused:
                    logger.info("s3://%s: ranged reads over presigned URLs answered HTTP %d; reading "
                                "through s3fs", bucket, response.status)
                self._refused.add(bucket)
        return None

    def _url(self, path: str) -> str | None:
        now = self._clock()
        with self._lock:
            known = self._urls.get(path)
        if known is not None and now - known[1] < _REUSE_SECONDS:
            return known[0]
        try:
            url = self.filesystem.url(path, expires=SIGNED_SECONDS)
        except Exception as err:  # no credentials, say: s3fs's own request names it
            logger.debug("%s: cannot presign (%s); reading through s3fs", path, err)
            return None
        if _proxied(url):
            return None
        with self._lock:
            if len(self._urls) >= _URLS_KEPT:
                self._urls.clear()
            self._urls[path] = (url, now)
        return url

    def _connections(self, url: str, scheme: str, host: str):
        """The kept-alive connections to the endpoint of ``url``."""
        with self._lock:
            pool = self._pools.get((scheme, host))
            if pool is None:
                import urllib3

                tls = {"ca_certs": _ca_bundle()} if scheme == "https" else {}
                pool = self._pools[(scheme, host)] = urllib3.connection_from_url(url, maxsize=8, **tls)
            return pool


def _proxied(url: str) -> bool:
    """Would a request to ``url`` go through a proxy (HTTP_PROXY, HTTPS_PROXY, minus NO_PROXY)?"""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].split("?", 1)[0]
    proxies = urllib.request.getproxies()
    return scheme in proxies and not urllib.request.proxy_bypass(host.rsplit(":", 1)[0])


def _ca_bundle() -> str | None:
    """The CA bundle botocore would verify TLS with: AWS_CA_BUNDLE, else certifi's, else the system's."""
    if os.environ.get("AWS_CA_BUNDLE"):
        return os.environ["AWS_CA_BUNDLE"]
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()
