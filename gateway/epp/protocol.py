"""The endpoint-picker protocol on Envoy's external processing API (ext_proc v3), in one module.

The Gateway API Inference Extension (``docs/proposals/004-endpoint-picker-protocol``) has the data plane
call the endpoint picker (EPP) over ext_proc for every request:

- request headers and body in; the subset the EPP must pick from may ride in the filter metadata
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list, or one comma-separated
  string, of ``ip:port``);
- the EPP answers with the chosen endpoints, ``ip:port[,ip:port...]`` (the first, then fallbacks in
  order), twice with one value: the request header ``x-gateway-destination-endpoint`` and the dynamic
  metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``; or with an ``ImmediateResponse`` (503 when no
  endpoint is eligible, 429 when the request is shed, and the API's own errors);
- the response: the data plane reports which endpoint served it, in the metadata ``envoy.lb`` /
  ``x-gateway-destination-endpoint-served``, or (plain Envoy) in the ``upstream.address`` attribute the
  ext_proc filter sends when asked (``response_attributes``).

Beyond the protocol, the end of the answer: the ext_proc stream closes when the HTTP stream ends; the
answer's own last bytes reach the EPP either as response body messages (when the data plane streams the
body to it) or, at no cost per chunk, through an Envoy access-log entry whose dynamic metadata ``kvgw`` /
``tail`` a Lua filter filled with the answer's last bytes (:mod:`gateway.epp.envoy_config`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# The ext_proc filter's own namespace in ``ProcessingRequest.attributes``, and the attribute naming the
# upstream host that answered.
ATTRIBUTES = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS = "upstream.address"
# Where the Lua filter of our Envoy config leaves the answer's last bytes (dynamic metadata).
TAIL_NAMESPACE = "kvgw"
TAIL_KEY = "tail"

ProcessingRequest = ext_proc.ProcessingRequest
ProcessingResponse = ext_proc.ProcessingResponse
FULL_DUPLEX = 4  # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


def _value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def request_head(headers: ext_proc.HttpHeaders) -> tuple[CIMultiDict[str], str, str]:
    """The client's headers (HTTP/2 pseudo-headers taken out: ``:authority`` becomes ``host``), method and
    path."""
    out: CIMultiDict[str] = CIMultiDict()
    method, path = "POST", "/"
    for header in headers.headers.headers:
        key = header.key
        if key[0] != ":":
            out.add(key, _value(header))
        elif key == ":path":
            path = _value(header)
        elif key == ":method":
            method = _value(header)
        elif key == ":authority":
            out.add("host", _value(header))
    return out, method, path


def status_of(headers: ext_proc.HttpHeaders) -> int:
    for header in headers.headers.headers:
        if header.key == ":status":
            try:
                return int(_value(header))
            except ValueError:
                return 502
    return 502


def content_type(headers: ext_proc.HttpHeaders) -> str:
    return next((_value(h) for h in headers.headers.headers if h.key == "content-type"), "")


def _metadata(request: ProcessingRequest, namespace: str) -> struct_pb2.Struct | None:
    filter_metadata = request.metadata_context.filter_metadata
    return filter_metadata[namespace] if namespace in filter_metadata else None


def subset(request: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the data plane allows for this request, when it says (None: the whole pool)."""
    hint = _metadata(request, SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    items: Iterable[str] = (
        [v.string_value for v in value.list_value.values] if value.HasField("list_value") else [value.string_value])
    return frozenset(e.strip() for item in items for e in item.split(",") if e.strip())


def served_endpoint(request: ProcessingRequest) -> str | None:
    """The ``ip:port`` that answered: the protocol's served metadata, else Envoy's ``upstream.address``."""
    lb = _metadata(request, LB_NAMESPACE)
    if lb is not None and SERVED in lb.fields and (served := lb.fields[SERVED].string_value):
        return served
    attributes = request.attributes
    if ATTRIBUTES in attributes and UPSTREAM_ADDRESS in attributes[ATTRIBUTES].fields:
        return attributes[ATTRIBUTES].fields[UPSTREAM_ADDRESS].string_value or None
    return None


def _header_mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()),
                                                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
                     for k, v in set_headers.items()],
        remove_headers=list(remove))


def destination(endpoints: list[str]) -> struct_pb2.Struct:
    """The dynamic metadata naming the endpoints, the same value as the header."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
    return metadata


def routed(endpoints: list[str], set_headers: Mapping[str, str], remove: Iterable[str], body: bytes | None,
           *, in_headers: bool, full_duplex: bool, client_body: bytes = b"") -> list[ProcessingResponse]:
    """The answer to a request: go to ``endpoints`` with these header edits (and ``body`` instead of the
    client's, when not None). ``in_headers``: the answer to the request headers (a request without a body,
    or a body the data plane streams, whose headers wait for it); else to the buffered body. In full-duplex
    mode the data plane forwards only the body the EPP sends back: ``body``, or else ``client_body``."""
    headers = {**set_headers, DESTINATION: ",".join(endpoints)}
    if body is not None:
        headers["content-length"] = str(len(body))
    common = ext_proc.CommonResponse(header_mutation=_header_mutation(headers, remove), clear_route_cache=True)
    metadata = destination(endpoints)
    if not in_headers:
        if body is not None:
            common.body_mutation.body = body
        return [ProcessingResponse(request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata)]
    out = [ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata)]
    if full_duplex:  # the body was held back: it goes on, whole, in one streamed chunk
        out.append(body_chunk(client_body if body is None else body, request=True))
    return out


def body_chunk(body: bytes, *, request: bool, end_of_stream: bool = True) -> ProcessingResponse:
    """A body passed on in full-duplex streaming mode (the data plane sends nothing the EPP did not echo)."""
    common = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
        streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)))
    response = ext_proc.BodyResponse(response=common)
    return ProcessingResponse(request_body=response) if request else ProcessingResponse(response_body=response)


CONTINUE_REQUEST_HEADERS = ProcessingResponse(request_headers=ext_proc.HeadersResponse())
CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=ext_proc.BodyResponse())
CONTINUE_REQUEST_BODY = ProcessingResponse(request_body=ext_proc.BodyResponse())
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def answer_headers(headers: Mapping[str, str]) -> ProcessingResponse:
    """The answer's headers go on to the client with the gateway's own added (``x-gateway-pod``, ...)."""
    return ProcessingResponse(response_headers=ext_proc.HeadersResponse(
        response=ext_proc.CommonResponse(header_mutation=_header_mutation(headers))))


def immediate(status: int, body: bytes, headers: Mapping[str, str]) -> ProcessingResponse:
    """Answer the client now, without any pod (an error in the API's shape, a 429 with Retry-After)."""
    return ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=_header_mutation({"content-type": "application/json", **headers}), details="kv_gateway_epp"))
