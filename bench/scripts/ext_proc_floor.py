"""The floor under the endpoint picker's cost: an ext_proc server that makes no decision.

    python bench/scripts/ext_proc_floor.py --grpc-port 9002 --endpoint 127.0.0.1:8000 [--stack grpc_aio|grpclib]

It speaks the same messages as ``gateway epp`` with buffered request bodies (gateway/epp/protocol.py): the
request headers go on, the body is answered with ``--endpoint`` in the destination header and metadata,
the answer's headers go on, and Envoy's access-log entries are read and dropped. No parsing, auth,
tokenizing or routing: what is left is the gRPC stack's own cost per request, on uvloop as the EPP runs.
``bench/scripts/epp_overhead.py --setups envoy+floor`` runs it behind the same Envoy as the EPP, so the two
compare request for request. ``grpclib`` (pure Python, no threads of its own) is not a dependency of the
gateway; install it to compare the stacks.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable

import uvloop
from envoy.service.accesslog.v3 import als_pb2

from gateway.epp import protocol

EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOG_PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def answerer(endpoint: str) -> Callable[[protocol.ProcessingRequest], protocol.ProcessingResponse | None]:
    """The reply to each message of a request's stream, as the EPP with buffered bodies sends it."""
    routed = protocol.routed([endpoint], {}, (), None, in_headers=False, full_duplex=False)[0]
    answer = protocol.answer_headers({"x-gateway-pod": "floor"})
    replies = {"request_headers": protocol.CONTINUE_REQUEST_HEADERS, "request_body": routed,
               "response_headers": answer, "response_body": protocol.CONTINUE_RESPONSE_BODY}
    return lambda message: replies.get(message.WhichOneof("request") or "")


async def serve_grpc_aio(port: int, endpoint: str) -> None:
    import grpc
    from envoy.service.accesslog.v3 import als_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

    reply = answerer(endpoint)

    class ExtProc(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
            while (message := await context.read()) is not grpc.aio.EOF:
                if (response := reply(message)) is not None:  # type: ignore[arg-type]
                    await context.write(response)

    class AccessLog(als_pb2_grpc.AccessLogServiceServicer):
        async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                                   context: object) -> als_pb2.StreamAccessLogsResponse:
            async for _ in request_iterator:
                pass
            return als_pb2.StreamAccessLogsResponse()

    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(ExtProc(), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def serve_grpclib(port: int, endpoint: str) -> None:
    try:
        from grpclib.const import Cardinality, Handler
        from grpclib.server import Server, Stream
    except ImportError:
        raise SystemExit("grpclib is not installed (it is no dependency of the gateway): pip install grpclib") from None

    reply = answerer(endpoint)

    class Floor:
        async def process(self, stream: Stream[protocol.ProcessingRequest, protocol.ProcessingResponse]) -> None:
            async for message in stream:
                if (response := reply(message)) is not None:
                    await stream.send_message(response)

        async def access_logs(self, stream: Stream[als_pb2.StreamAccessLogsMessage,
                                                    als_pb2.StreamAccessLogsResponse]) -> None:
            async for _ in stream:
                pass
            await stream.send_message(als_pb2.StreamAccessLogsResponse())

        def __mapping__(self) -> dict[str, Handler]:
            return {EXT_PROC_PATH: Handler(self.process, Cardinality.STREAM_STREAM, protocol.ProcessingRequest,
                                           protocol.ProcessingResponse),
                    ACCESS_LOG_PATH: Handler(self.access_logs, Cardinality.STREAM_UNARY,
                                             als_pb2.StreamAccessLogsMessage, als_pb2.StreamAccessLogsResponse)}

    server = Server([Floor()])
    await server.start("127.0.0.1", port)
    await server.wait_closed()


STACKS = {"grpc_aio": serve_grpc_aio, "grpclib": serve_grpclib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="ip:port every request is sent to")
    parser.add_argument("--stack", choices=sorted(STACKS), default="grpc_aio")
    args = parser.parse_args()
    uvloop.run(STACKS[args.stack](args.grpc_port, args.endpoint))


if __name__ == "__main__":
    main()
