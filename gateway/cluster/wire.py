"""The state bus wire format: one datagram (between the workers of one replica, over Unix sockets) or
one Redis pub/sub message (between replicas) is one msgpack ``Batch``::

    [origin, replica, [fact, fact, ...]]

``origin`` names the sending process (``<replica>/w<index>/<pid>``: a restarted worker is a new origin,
so nothing of its previous life stays counted). ``replica`` lets a worker ignore, on Redis, what its own
siblings already sent it directly. The facts are :mod:`gateway.core.facts`; a batch with none is a
heartbeat.
"""

from __future__ import annotations

import msgspec

from gateway.core.facts import AnyFact


class Batch(msgspec.Struct, array_like=True):
    origin: str
    replica: str
    facts: list[AnyFact]


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Batch)
