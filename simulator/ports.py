"""Where simulated pods listen: ports free now, for a pod to bind later (chosen outside the kernel's ephemeral
range), and the endpoints a pod says it listens on. Light to import: the launcher, in the gateway's own process,
reads it before the gateway starts."""

from __future__ import annotations

import random
import socket

import msgspec


class PodEndpoints(msgspec.Struct, frozen=True):
    """Where one pod of a group answers: what ``gateway mock --pods N`` prints, one line per pod."""

    index: int
    url: str
    events: str | None
    replay: str | None


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1", rng: random.Random | None = None,
               avoid: frozenset[int] = frozenset()) -> list[int]:
    """``n`` distinct ports free now, chosen outside the kernel's ephemeral range and outside ``avoid`` (ports
    someone is about to bind: the gateway's own, beside its simulated pods). Whoever asked binds them later;
    meanwhile a port from the ephemeral range can become the local end of any outgoing connection (seen in CI:
    "Address already in use" on a simulated pod's KV-event replay port), a port outside it only another
    listener's."""
    rng = rng or random.SystemRandom()
    low, high = _ephemeral_range()
    first, last = (10_000, low - 1) if low > 12_000 else (high + 1, 65_535) if high < 64_000 else (1024, 65_535)
    chosen: list[int] = []
    while len(chosen) < n:
        port = rng.randint(first, last)
        if port in chosen or port in avoid:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        chosen.append(port)
    return chosen
