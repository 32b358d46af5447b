"""The KV-cache event wire format of vLLM and SGLang, in one place.

Live messages, PUB → SUB, three frames::

    [topic: bytes, seq: 8 bytes big-endian unsigned, payload: msgpack EventBatch]

Replay, our DEALER → their ROUTER: we send ``[b"", start_seq]``; the reply is one message per buffered
batch with ``seq >= start_seq``, then an end marker whose seq is all ones::

    vLLM >= 0.26, SGLang:  [b"", topic, seq, payload] ...  end: [b"", b"", 0xFF * 8, b""]
    vLLM <= 0.25:          [b"", seq, payload] ...         end: [b"", 0xFF * 8, b""]

``EventBatch`` is a positional array ``[ts, events, dp_rank]`` (two elements in old vLLM). Each event is
a map tagged by ``"type"`` since vLLM 0.24 (and in SGLang); vLLM <= 0.23 sent tagged arrays
``["BlockStored", field, field, ...]`` in the field order below.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgspec

Hash = int | bytes

END_OF_REPLAY_SEQ = b"\xff" * 8


class Encoding(enum.StrEnum):
    """Which engine release's wire format a publisher speaks."""

    CURRENT = "current"  # vLLM >= 0.26: tagged maps, replay with topic frame
    V0_25 = "v0.25"  # vLLM 0.24-0.25: tagged maps, replay without topic frame
    V0_23 = "v0.23"  # vLLM <= 0.23: tagged arrays, 2-element batches, replay without topic frame
    SGLANG = "sglang"  # tagged maps, always 3-element batches, signed int64 hashes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block: None, or what else went into the engine's hash (multimodal ids, cache salt, ...).
    extra_keys: list[Any] | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[Hash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_seq(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def decode_seq(frame: bytes) -> int:
    return struct.unpack(">Q", frame)[0]


def encode_batch(batch: EventBatch, encoding: Encoding) -> bytes:
    """The msgpack payload of one batch, as the given engine release writes it."""
    if encoding is not Encoding.V0_23:
        if encoding is Encoding.SGLANG:
            # SGLang always writes the rank slot, even when it is None.
            return _encoder.encode([batch.ts, batch.events, batch.data_parallel_rank])
        return _encoder.encode(batch)
    events = [[type(e).__name__, *msgspec.structs.astuple(e)] for e in batch.events]
    return _encoder.encode([batch.ts, events])


def replay_message(topic: bytes, seq: int, payload: bytes, encoding: Encoding) -> list[bytes]:
    """One replayed batch, without the ROUTER identity frame."""
    if encoding in (Encoding.V0_23, Encoding.V0_25):
        return [b"", encode_seq(seq), payload]
    return [b"", topic, encode_seq(seq), payload]


def replay_end(encoding: Encoding) -> list[bytes]:
    if encoding in (Encoding.V0_23, Encoding.V0_25):
        return [b"", END_OF_REPLAY_SEQ, b""]
    return [b"", b"", END_OF_REPLAY_SEQ, b""]


# Decoding: the fast path is a typed decode of the current form; anything else (legacy tagged arrays,
# unknown event types, stray fields of the wrong type) goes through a tolerant generic path that keeps
# every event it can read and counts the rest.


class BadEventBatch(ValueError):
    """The payload is not an event batch at all."""


class DecodedBatch(msgspec.Struct):
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None
    skipped: int = 0  # events that could not be read


_typed_decoder = msgspec.msgpack.Decoder(EventBatch)
_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared,
}


def decode_batch(payload: bytes) -> DecodedBatch:
    try:
        batch = _typed_decoder.decode(payload)
        return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank)
    except (msgspec.MsgspecError, UnicodeDecodeError):  # msgspec reports bad UTF-8 as UnicodeDecodeError
        pass
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise BadEventBatch(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise BadEventBatch("not a [ts, events, dp_rank] array")
    ts = raw[0] if isinstance(raw[0], int | float) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events: list[KvEvent] = []
    skipped = 0
    for item in raw[1]:
        event = _decode_event(item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return DecodedBatch(float(ts), events, rank, skipped)


def _decode_event(item: Any) -> KvEvent | None:
    if isinstance(item, dict):
        cls = _EVENT_TYPES.get(item.get("type"))  # type: ignore[arg-type]
        fields = {k: v for k, v in item.items() if k != "type"}
    elif isinstance(item, list) and item and isinstance(item[0], str):
        cls = _EVENT_TYPES.get(item[0])
        fields = dict(zip(cls.__struct_fields__, item[1:], strict=False)) if cls else {}
    else:
        return None
    if cls is None:
        return None
    try:
        return msgspec.convert(fields, cls)  # type: ignore[return-value]
    except msgspec.ValidationError:
        return None
