"""The physical limit of the PS data plane: a Python gRPC server that echoes bytes.

Generic handlers with no (de)serializers: the request bytes object is the response
(unary: one message as large as the model; stream: the model in 1 MB messages).
It is built with elasticdl.rpc.channel.make_server, so thread pool and message limits are
the parameter server's.

    python -m benchmarks.echo_server --ready_file PATH
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

import grpc

from elasticdl.rpc.channel import bind_local, make_channel, make_server

METHOD = "/bench.Echo/Echo"
STREAM_METHOD = "/bench.Echo/EchoStream"  # each message back as it arrives


class _Echo(grpc.GenericRpcHandler):
    def service(self, handler_call_details):
        if handler_call_details.method == METHOD:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        if handler_call_details.method == STREAM_METHOD:
            return grpc.stream_stream_rpc_method_handler(lambda requests, context: (r for r in requests))
        return None


def echo_stub(address: str):
    """A callable bytes -> bytes, one streaming bytes chunks -> chunks, and the channel."""
    channel = make_channel(address)
    return channel.unary_unary(METHOD), channel.stream_stream(STREAM_METHOD), channel


def main() -> None:
    from elasticdl.launch.child import die_with_parent

    die_with_parent()  # no orphans if the benchmark is killed
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready_file", required=True)
    args = parser.parse_args()
    server = make_server()
    server.add_generic_rpc_handlers((_Echo(),))
    port = bind_local(server)
    server.start()
    with open(args.ready_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(args.ready_file + ".tmp", args.ready_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
