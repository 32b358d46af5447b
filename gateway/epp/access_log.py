"""How each answer ended, from Envoy's gRPC access log (``envoy.access_loggers.http_grpc``).

Envoy writes one entry per request when it is done: the status the client got, the flags saying how it
ended (the client left, the pod broke off, Envoy could not reach it), and the dynamic metadata, where the
Lua filter of our Envoy config leaves the answer's last bytes (``kvgw`` / ``tail``: the usage of a stream
rides in its last event). One message per request whatever the answer's length: the cheap and exact way
for the EPP to see the end of an answer Envoy relayed.

Owner: :class:`AccessLogs` holds the entries awaited by the requests in flight (one future each, from the
request's id to its end); the access-log service fills them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from gateway.epp.protocol import TAIL_KEY, TAIL_NAMESPACE
from gateway.proxy.outcome import Ending

log = logging.getLogger("gateway.epp")


@dataclass(frozen=True, slots=True)
class Ended:
    """One request's end as Envoy logged it."""

    status: int  # what the client was sent (0: nothing)
    client_left: bool
    upstream_broke: bool  # the pod reset or stopped mid-answer, or timed out
    upstream_connect_failed: bool
    tail: bytes  # the answer's last bytes (empty without the Lua filter)

    def status_and_ending(self, answered: int) -> tuple[int, Ending]:
        """The request's status and ending, given the status its answer's headers had."""
        if self.client_left:
            return 499, Ending.CLIENT_GONE
        if self.upstream_broke and answered < 400:
            return 502, Ending.UPSTREAM_BROKE
        return self.status or answered, Ending.COMPLETE

    @classmethod
    def of(cls, entry: accesslog_pb2.HTTPAccessLogEntry) -> Ended:
        common = entry.common_properties
        flags = common.response_flags
        metadata = common.metadata.filter_metadata
        tail = b""
        if TAIL_NAMESPACE in metadata and TAIL_KEY in metadata[TAIL_NAMESPACE].fields:
            tail = metadata[TAIL_NAMESPACE].fields[TAIL_KEY].string_value.encode("utf-8", "surrogateescape")
        return cls(
            status=entry.response.response_code.value,
            client_left=flags.downstream_connection_termination,
            upstream_broke=(flags.upstream_connection_termination or flags.upstream_remote_reset
                            or flags.stream_idle_timeout or flags.upstream_request_timeout),
            upstream_connect_failed=flags.upstream_connection_failure,
            tail=tail,
        )


class AccessLogs:
    """The requests in flight awaiting their entry, by request id (Envoy's ``x-request-id``)."""

    def __init__(self, mode: bool | str = "auto") -> None:
        self._waiting: dict[str, asyncio.Future[Ended]] = {}
        self._mode = mode  # epp.access_log
        self._streams = 0  # Envoy's access-log streams opened so far
        self.received = 0
        self.unmatched = 0

    @property
    def live(self) -> bool:
        """Whether Envoy streams entries to us (else no request waits for one). Envoy opens its stream
        with its first entry: in ``auto`` mode the EPP's first request after a start ends without one."""
        return self._mode is True or (self._mode == "auto" and self._streams > 0)

    def expect(self, request_id: str) -> asyncio.Future[Ended]:
        future = self._waiting.get(request_id)
        if future is None:
            future = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def logged(self, request_id: str, ended: Ended) -> None:
        self.received += 1
        future = self._waiting.pop(request_id, None)
        if future is None:
            self.unmatched += 1  # a request this EPP did not route (or one already forgotten)
        elif not future.done():
            future.set_result(ended)

    def stream_opened(self) -> None:
        self._streams += 1



class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's access-log streams, each entry handed to :class:`AccessLogs`."""

    def __init__(self, logs: AccessLogs) -> None:
        self._logs = logs

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                               context: object) -> als_pb2.StreamAccessLogsResponse:
        self._logs.stream_opened()
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self._logs.logged(entry.request.request_id, Ended.of(entry))
        return als_pb2.StreamAccessLogsResponse()
