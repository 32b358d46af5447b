"""Fuzzing the KV-event path: whatever arrives, decoding raises only BadEventBatch and the index never
raises (hypothesis)."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.kv.events import BadEventBatch, decode_batch
from gateway.kv.index import PrefixIndex

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=False), st.text(max_size=12), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=6)),
                      max_leaves=30)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
    optional={"block_hashes": st.lists(st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1),
                                                 st.binary(max_size=32), st.text(max_size=4)), max_size=4),
              "parent_block_hash": st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
              "token_ids": st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=12),
              "block_size": st.integers(min_value=-2, max_value=6),
              "medium": st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "disk"]), st.integers(-5, 5)),
              "lora_name": st.one_of(st.none(), st.text(max_size=5)),
              "extra_keys": st.one_of(st.none(), st.lists(values, max_size=3)),
              "lookahead_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2))},
)
batches = st.one_of(
    st.tuples(st.floats(allow_nan=False), st.lists(st.one_of(event_like, values), max_size=5)).map(list),
    st.tuples(st.floats(allow_nan=False), st.lists(event_like, max_size=5), st.one_of(st.none(), st.integers(-9, 9)))
    .map(list),
    values,
)


def apply_all(payload: bytes, index: PrefixIndex) -> None:
    try:
        batch = decode_batch(payload)
    except BadEventBatch:
        return
    index.apply(index.view("p", 0, "m"), batch.events)
    index.lookup("m", None, list(range(40)), ["p"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes(payload):
    apply_all(payload, PrefixIndex())


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_random_structures(batch):
    apply_all(msgspec.msgpack.encode(batch), PrefixIndex())
