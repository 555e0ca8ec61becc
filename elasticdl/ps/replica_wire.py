"""A replicated update on the wire between two PS (docs/replicas.md): the entry's header as JSON
in the call's metadata, its arrays as the same messages a worker sends (lossless float32 bytes),
and the forwarder that sends it to a backup's PS.

The arrays travel exactly as they were applied, so the backup applies the same bits.
"""

from __future__ import annotations

import json

import grpc
import numpy as np

from elasticdl.model.embedding.table import IndexedRows, TableInfo
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.proto import elasticdl_pb2
from elasticdl.ps.replication import Entry
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc import replica_commands as wire
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.channel import make_channel
from elasticdl.rpc.trust import MASTER_CREDENTIAL_HEADER

_PUSH_TENSORS = elasticdl_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number
_MODEL_TENSORS = elasticdl_pb2.Model.DESCRIPTOR.fields_by_name["dense_parameters"].number


def encode_entry(entry: Entry) -> tuple[str, bytes]:
    """(the JSON header, the payload) of ``entry``."""
    header = {"shard": entry.shard, "seq": entry.seq, "op": entry.op}
    payload = b""
    if entry.op == "push":
        grads, version, learning_rate, batch, worker_id = entry.args
        dense = {n: v for n, v in grads.items() if not isinstance(v, (IndexedRows, NonTrainableChange))}
        head = elasticdl_pb2.PushGradientsRequest(
            worker_id=worker_id, version=version, learning_rate=learning_rate,
            embedding_gradients=[
                elasticdl_pb2.IndexedRows(name=n, ids=tensor_codec.encode("ids", v.ids),
                                          values=tensor_codec.encode("values", v.values))
                for n, v in grads.items() if isinstance(v, IndexedRows)],
            non_trainable_changes=[tensor_codec.encode(n, v.values) for n, v in grads.items()
                                   if isinstance(v, NonTrainableChange)],
        )
        if batch is not None:
            head.task_id, head.handout, head.records_end, head.records = (
                batch.task_id, batch.handout, batch.records_end, batch.records)
            head.ticket = batch.ticket
            header["batch"] = True
        payload = tensor_codec.serialize_with_tensors(head, _PUSH_TENSORS, dense)
    elif entry.op == "model":
        params, version, non_trainable = entry.args
        head = elasticdl_pb2.Model(version=version, variables=sorted(params), non_trainable=sorted(non_trainable))
        payload = tensor_codec.serialize_with_tensors(head, _MODEL_TENSORS, params)
    elif entry.op == "tables":
        (infos,) = entry.args
        header["args"] = [[info.name, info.dim, info.to_json()] for info in infos]
    elif entry.op == "lookup":  # the ids as raw int64 bytes: no JSON for thousands of numbers
        name, ids, create = entry.args
        header["args"] = [name, bool(create)]
        payload = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    else:
        header["args"] = list(entry.args)
    return json.dumps(header), bytes(payload)


def decode_entry(header: str, payload: bytes) -> Entry:
    """The entry ``encode_entry`` made (ValueError for one no PS sends)."""
    fields = json.loads(header)
    op, shard, seq = fields["op"], int(fields["shard"]), int(fields["seq"])
    if op == "push":
        head = elasticdl_pb2.PushGradientsRequest.FromString(payload)
        grads: dict = dict(tensor_codec.decode_list(head.gradients))  # views, as a worker's push is read
        for rows in head.embedding_gradients:
            grads[rows.name] = IndexedRows(tensor_codec.decode(rows.ids), tensor_codec.decode(rows.values))
        for name, values in tensor_codec.decode_list(head.non_trainable_changes, writable=True).items():
            grads[name] = NonTrainableChange(values)
        batch = (BatchPosition(head.task_id, head.handout, head.records_end, head.records, head.ticket)
                 if fields.get("batch") else None)
        lr = head.learning_rate if head.HasField("learning_rate") else None
        return Entry(shard, seq, op, (grads, head.version, lr, batch, head.worker_id))
    if op == "model":
        head = elasticdl_pb2.Model.FromString(payload)
        params = tensor_codec.decode_list(head.dense_parameters, writable=True)
        return Entry(shard, seq, op, (params, head.version, list(head.non_trainable)))
    if op == "tables":
        return Entry(shard, seq, op, ([TableInfo.from_json(n, int(d), j) for n, d, j in fields["args"]],))
    if op == "lookup":
        name, create = fields["args"]
        return Entry(shard, seq, op, (name, np.frombuffer(payload, "<i8").astype(np.int64), bool(create)))
    return Entry(shard, seq, op, tuple(fields.get("args", ())))


class GrpcForwarder:
    """Sends entries to the backups' PS (``forward`` is a replication.Forwarder): a call that
    does not reach its PS, or that the backup could not take, is a ConnectionError."""

    def __init__(self, addresses: list[str], token: str | None, master_credential: str):
        self._token = token
        self._addresses = list(addresses)
        self._channels = [make_channel(a, token) for a in addresses]
        self._credential = master_credential  # a PS holds the job key: replicate is the master's side's

    def set_addresses(self, addresses: list[str]) -> None:
        """Peers' replica servers, again (a relaunched one listens on a new port)."""
        for ps, address in enumerate(addresses):
            if address != self._addresses[ps]:
                old, self._channels[ps] = self._channels[ps], make_channel(address, self._token)
                self._addresses[ps] = address
                old.close()

    def forward(self, backup_ps: int, entry: Entry) -> None:
        header, payload = encode_entry(entry)
        try:
            wire.call(self._channels[backup_ps], "replicate", payload,
                      [(wire.ENTRY_HEADER, header), (MASTER_CREDENTIAL_HEADER, self._credential)])
        except grpc.RpcError as err:
            raise ConnectionError(f"PS {backup_ps}: {err.code().name} {err.details()}") from None

    def install(self, backup_ps: int, shard: int, seq: int, snapshot: bytes) -> None:
        """Send a new backup its shard's snapshot at update ``seq`` (a catch-up)."""
        header = json.dumps({"shard": shard, "seq": seq})
        try:
            wire.call(self._channels[backup_ps], "install", snapshot,
                      [(wire.ENTRY_HEADER, header), (MASTER_CREDENTIAL_HEADER, self._credential)])
        except grpc.RpcError as err:
            raise ConnectionError(f"PS {backup_ps}: {err.code().name} {err.details()}") from None

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
