"""What the master hands out, signed: per-worker credentials and training tickets.

The job's token (``auth.py``) only says "a role of this job": every role holds it, so on its
own it cannot stop one caller from forging another's evidence. A second secret, the *job key*,
is held by the master and the PS only (never by a worker, never in the job's token Secret):

- a **worker credential** is ``HMAC(key, "worker:<id>")``. The master mints one for each
  worker id it launches and hands it to that worker only (its environment, on any backend).
  The master's RPCs that name a worker id require it (``WORKER_CREDENTIAL_HEADER``), so a
  phantom id, or another worker's, is refused (``PERMISSION_DENIED``);
- a **ticket** binds one training hand-out: task id, hand-out, worker id and the record range
  ``[start, end)``, with ``HMAC(key, "ticket:" + fields)``. The master signs one with every
  training task; the worker sends it back with each push; the PS checks it, so a push's task,
  hand-out and records can only be ones the master handed out (``TicketVerifier``).

- the **master's credential** is ``HMAC(key, "master")``: the PS take the commands only the
  master gives (checkpoint, restore, fence, live workers, snapshots, learning rate) only with it
  (``MASTER_CREDENTIAL_HEADER``), so a worker cannot fence another's hand-out or roll the
  model back.

Domain separation ("worker:" / "ticket:" / "master") keeps one from passing for another.

Where the key comes from: ``$ELASTICDL_JOB_KEY_FILE`` names a 0600 file holding it (locally a
file of the backend's private directory, given to the master and the PS processes only; on
Kubernetes the job's *keys* Secret, mounted in the master and PS pods only).

Example::

    key = new_job_key()
    ticket = mint_ticket(key, TicketFields(task_id=7, handout=3, worker_id=1, start=0, end=64))
    TicketVerifier(key).problem(ticket, task_id=7, handout=3, worker_id=1, records_end=32, records=32)  # ''
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from dataclasses import dataclass

from elasticdl.rpc.auth import TokenError, read_token_file

JOB_KEY_FILE_ENV = "ELASTICDL_JOB_KEY_FILE"
JOB_KEY_FILE_NAME = "job-key"  # locally, in the backend's private (0700) directory
WORKER_CREDENTIAL_ENV = "ELASTICDL_WORKER_CREDENTIAL"
WORKER_CREDENTIAL_HEADER = "elasticdl-worker-credential"  # gRPC metadata keys are lower case
MASTER_CREDENTIAL_HEADER = "elasticdl-master-credential"

_FIELDS = struct.Struct(">qqqqq")  # task_id, handout, worker_id, start, end
_MAC_BYTES = 32


def new_job_key() -> str:
    """A fresh job key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def job_key() -> str | None:
    """The key in the file ``$ELASTICDL_JOB_KEY_FILE`` names, or None when it is not set."""
    path = os.environ.get(JOB_KEY_FILE_ENV, "")
    return read_token_file(path, JOB_KEY_FILE_ENV) if path else None


def require_job_key(who: str) -> str:
    """The job key for ``who`` (the master or a PS), or a TokenError saying how to give it."""
    key = job_key()
    if key is None:
        raise TokenError(
            f"{who} refuses to start without the job key: ${JOB_KEY_FILE_ENV} is not set. The master hands it "
            "to the PS it starts (on Kubernetes, through the job's keys Secret); to start one by hand, set "
            f"${JOB_KEY_FILE_ENV} to a 0600 file holding the job key"
        )
    return key


def _mac(key: str, domain: bytes, message: bytes) -> bytes:
    return hmac.new(key.encode(), domain + message, hashlib.sha256).digest()


def worker_credential(key: str, worker_id: int) -> str:
    """The credential of worker ``worker_id`` (hex): only a holder of ``key`` can make one."""
    return _mac(key, b"worker:", str(int(worker_id)).encode()).hex()


def credential_problem(key: str, worker_id: int, credential: str) -> str:
    """Why ``credential`` does not prove ``worker_id`` ('' when it does)."""
    if not credential:
        return (f"a call naming worker {worker_id} without the worker's credential (metadata "
                f"{WORKER_CREDENTIAL_HEADER!r}): only the master's workers get tasks, each with the credential "
                f"the master handed it at launch (${WORKER_CREDENTIAL_ENV})")
    if not hmac.compare_digest(credential.encode(), worker_credential(key, worker_id).encode()):
        return (f"the credential sent is not worker {worker_id}'s: no worker {worker_id} was launched by this "
                "master, or the caller is another worker")
    return ""


def master_credential(key: str) -> str:
    """The master's credential (hex): the PS take the master's commands only with it."""
    return _mac(key, b"master", b"").hex()


@dataclass(frozen=True)
class TicketFields:
    """One training hand-out, as the master issued it."""

    task_id: int
    handout: int
    worker_id: int
    start: int  # the task's first record index in its file, inclusive
    end: int  # exclusive


def mint_ticket(key: str, fields: TicketFields) -> bytes:
    """The ticket of ``fields``: the fields in the clear, then their MAC."""
    body = _FIELDS.pack(fields.task_id, fields.handout, fields.worker_id, fields.start, fields.end)
    return body + _mac(key, b"ticket:", body)


class TicketVerifier:
    """Checks a push's ticket against what the push claims (a PS holds one per job key)."""

    def __init__(self, key: str):
        if not key:
            raise TokenError("a ticket verifier needs the job key")
        self._key = key

    def master_problem(self, credential: str) -> str:
        """Why ``credential`` is not the master's ('' when it is)."""
        if hmac.compare_digest(credential.encode(), master_credential(self._key).encode()):
            return ""
        return (f"only the master gives this command, and the call did not carry the master's credential "
                f"(metadata {MASTER_CREDENTIAL_HEADER!r}): a worker or a tool holds the job's token, not its key")

    def read(self, ticket: bytes) -> TicketFields | None:
        """The fields of a ticket the master signed; None for any other bytes."""
        if len(ticket) != _FIELDS.size + _MAC_BYTES:
            return None
        body, mac = ticket[:_FIELDS.size], ticket[_FIELDS.size:]
        if not hmac.compare_digest(mac, _mac(self._key, b"ticket:", body)):
            return None
        return TicketFields(*_FIELDS.unpack(body))

    def problem(self, ticket: bytes, task_id: int, handout: int, worker_id: int, records_end: int,
                records: int) -> str:
        """Why a push of ``records`` records of task ``task_id`` ending before ``records_end``
        is not covered by ``ticket`` ('' when it is)."""
        if not ticket:
            return (f"a training push of task {task_id} without a ticket: this PS takes only pushes of hand-outs "
                    "the master issued, each with the ticket the master signed for it")
        fields = self.read(bytes(ticket))
        if fields is None:
            return (f"the ticket of the push of task {task_id} does not verify: it was not signed by this job's "
                    "master (forged, altered, or of another job)")
        claimed = (task_id, handout, worker_id)
        if (fields.task_id, fields.handout, fields.worker_id) != claimed:
            return (f"the push names task {task_id}, hand-out {handout}, worker {worker_id}; its ticket is for "
                    f"task {fields.task_id}, hand-out {fields.handout}, worker {fields.worker_id}")
        if not fields.start < records_end <= fields.end:
            return (f"the push's records_end {records_end} is outside its ticket's records "
                    f"[{fields.start}, {fields.end}) of task {task_id}")
        if records > records_end - fields.start:
            return (f"the push counts {records} records ending before {records_end}; task {task_id} starts at "
                    f"{fields.start}, so at most {records_end - fields.start}")
        return ""
