"""A request's body as the client meant it: read, decoded from its ``content-encoding``, bounded.

The server hands the gateway the bytes as sent (``auto_decompress`` off: aiohttp's own decoding refuses a
bad body in plain text, sometimes before any handler runs); here they are decoded with each codec the
header lists, last applied first (a gzip body of several members, or zstd of several frames, whole), and a
body that cannot be is the client's fault (400 in the route's own error shape; bytes after the compressed
data are refused, not ignored), as is one larger than ``server.max_body_bytes``, sent or decoded (413; a
small compressed body may expand without bound), or one that takes longer than ``server.body_timeout_s`` to
arrive (408). The pod receives the decoded bytes, without the header.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from typing import Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.core.errors import ErrorKind, GatewayError, bad_request

try:  # Python 3.14 has it; older ones take the backport (a dependency)
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd  # type: ignore[import-not-found,no-redef]

import brotli

# A decoder of one codec: (data, limit) -> the decoded bytes, or more than ``limit`` of them when the
# whole would be larger (decoding stops there).
Decoder = Callable[[bytes, int], bytes]


GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


class _OneStream(Protocol):
    """A decompressor of one stream (zlib's, zstd's): what it has not read after its end is ``unused_data``."""

    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes, max_length: int, /) -> bytes: ...


def _members(start: Callable[[], _OneStream], name: str, magic: bytes | None) -> Callable[[], Decoder]:
    """A decoder of ``name`` streams made by ``start``. ``magic``: the format allows streams one after
    another (gzip's members, zstd's frames; ``cat a.gz b.gz``), each starting with these bytes, each
    decoded in turn; bytes after the last that start none are refused (none: any bytes after the end)."""

    def make() -> Decoder:
        def decode(data: bytes, limit: int) -> bytes:
            out = bytearray()
            while True:
                decompressor = start()
                out += decompressor.decompress(data, limit + 1 - len(out))
                if len(out) > limit:
                    return bytes(out)
                if not decompressor.eof:
                    raise ValueError("the compressed data ends early")
                data = decompressor.unused_data
                if not data:
                    return bytes(out)
                if magic is None or not data.startswith(magic):
                    raise ValueError(f"{len(data)} bytes after the end of the {name} data are not {name} data")

        return decode

    return make


def _gzip() -> _OneStream:
    return zlib.decompressobj(16 + zlib.MAX_WBITS)


def _deflate() -> Decoder:
    """``deflate`` is zlib-wrapped by the spec, raw DEFLATE by many clients: both are read."""
    zlib_wrapped = _members(lambda: zlib.decompressobj(zlib.MAX_WBITS), "deflate", None)()
    raw = _members(lambda: zlib.decompressobj(-zlib.MAX_WBITS), "deflate", None)()

    def decode(data: bytes, limit: int) -> bytes:
        try:
            return zlib_wrapped(data, limit)
        except zlib.error:
            return raw(data, limit)

    return decode


def _brotli() -> Decoder:
    decompressor = brotli.Decompressor()  # refuses bytes after its stream itself

    def decode(data: bytes, limit: int) -> bytes:
        out = decompressor.process(data, output_buffer_limit=limit + 1)
        if len(out) <= limit and not decompressor.is_finished():
            raise ValueError("the compressed data ends early")
        return out

    return decode


DECODERS: dict[str, Callable[[], Decoder]] = {
    "gzip": _members(_gzip, "gzip", GZIP_MAGIC), "x-gzip": _members(_gzip, "gzip", GZIP_MAGIC), "deflate": _deflate,
    "br": _brotli, "zstd": _members(zstd.ZstdDecompressor, "zstd", ZSTD_MAGIC),
}


async def read_body(http: web.Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The body, decoded; raises a :class:`GatewayError` for one that cannot be read, is too large (413),
    or has not arrived whole within ``timeout_s`` (408)."""
    try:
        async with asyncio.timeout(timeout_s):
            data = await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(f"The request body is larger than {max_bytes} bytes.") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        raise bad_request(f"The request body could not be read: {exc}", code="invalid_body") from None
    except TimeoutError:
        raise GatewayError(ErrorKind.REQUEST_TIMEOUT, f"The request body did not arrive within {timeout_s:g} s.",
                           code="request_timeout") from None
    return decode_body(data, http.headers.get("content-encoding"), max_bytes)


def too_large(message: str) -> GatewayError:
    return GatewayError(ErrorKind.TOO_LARGE, message, code="request_too_large")


def decode_body(data: bytes, header: str | None, max_bytes: int) -> bytes:
    """``data`` decoded with each codec its ``content-encoding`` header lists (none: as it is)."""
    if not header:
        return data
    for encoding in reversed([e.strip().lower() for e in header.split(",") if e.strip()]):
        if encoding == "identity":
            continue
        make = DECODERS.get(encoding)
        if make is None:
            raise bad_request(f"Content-Encoding `{encoding}` is not supported (gzip, deflate, br, zstd are).",
                              code="unsupported_content_encoding")
        try:
            data = make()(data, max_bytes)
        except Exception as exc:  # each codec has its own error type; any failure is the body's
            raise bad_request(f"The request body is not valid {encoding} data ({exc}).", code="invalid_body") from None
        if len(data) > max_bytes:
            raise too_large(f"The request body decodes to more than {max_bytes} bytes.")
    return data
