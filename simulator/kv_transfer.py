"""The simulated pod's KV connectors, as vLLM's ``--kv-transfer-config`` sets them up.

Owner: one connector per simulated pod, driven by its engine (what a sequence can load, a prompt computed)
and its HTTP layer (the ``kv_transfer_params`` of a request and of its answer).

- ``ExampleConnector`` (shared storage, formerly ``SharedStorageConnector``): every computed prompt is
  saved under a directory named by a hash of its whole blocks, and a request whose prompt (less its last
  token, cut to whole blocks) was saved loads it, whoever computed it. No request fields: any two pods
  sharing the directory share their prompts. As in vLLM, only the same whole prompt matches, not a prefix.
- ``NixlConnector``: a request carrying ``kv_transfer_params.do_remote_decode`` is a prefill leg: its
  blocks outlive it until a consumer pulls them (or a lease ends), and its answer carries the parameters
  to pull them with (vLLM's own fields). A request carrying ``do_remote_prefill`` pulls them from the pod
  named there before it runs, over that pod's side channel (here its HTTP port, ``POST /nixl/read``);
  an unreachable pod, another engine id than the one named (a restarted pod) or blocks already gone fail
  the request as vLLM does (HTTP 500 "Internal server error"), or, with ``kv_load_failure_policy:
  recompute``, the pod computes the prompt itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
import msgspec

from simulator.engine import Sequence

log = logging.getLogger("simulator")

# vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long a producer keeps blocks nobody pulls.
NIXL_LEASE_S = 480.0
SIDE_CHANNEL_PATH = "/nixl/read"


class KvTransferConfig(msgspec.Struct):
    """The fields of vLLM's ``--kv-transfer-config`` the simulator reads (the rest are accepted)."""

    kv_connector: str
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_connector_extra_config: dict[str, Any] = {}
    kv_buffer_device: str = "cuda"
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    engine_id: str | None = None


class KvLoadFailed(Exception):
    """A consumer could not pull the blocks its request names (vLLM finishes it with an error)."""


def parse_kv_transfer_config(text: str) -> KvTransferConfig:
    config = msgspec.json.decode(text, type=KvTransferConfig)
    if config.kv_connector not in ("ExampleConnector", "SharedStorageConnector", "NixlConnector"):
        raise ValueError(f"the simulated pod has no {config.kv_connector} (ExampleConnector, NixlConnector)")
    return config


class SharedStorage:
    """vLLM's ExampleConnector: prompts saved to, and loaded from, a directory the pods share."""

    def __init__(self, path: str, block_size: int) -> None:
        self._path = path
        self._block_size = block_size
        os.makedirs(path, exist_ok=True)

    def _folder(self, tokens: list[int]) -> str:
        digest = hashlib.sha256(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)).hexdigest()
        return os.path.join(self._path, digest)

    def _aligned(self, n: int) -> int:
        return (n - 1) // self._block_size * self._block_size

    def loadable(self, seq: Sequence) -> int:
        # vLLM looks up the prompt less its last token, cut to whole blocks.
        n = self._aligned(seq.prompt_len - 1)
        return n if n > 0 and os.path.isdir(self._folder(seq.token_ids[:n])) else 0

    def prefilled(self, seq: Sequence) -> None:
        n = self._aligned(seq.prompt_len)
        folder = self._folder(seq.token_ids[:n])
        if n > 0 and not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "kv_cache.json"), "w") as f:
                f.write(f'{{"tokens": {n}}}')


class Nixl:
    """vLLM's NixlConnector: a producer keeps a prefill's blocks for a consumer to pull."""

    def __init__(self, config: KvTransferConfig, host: str, release: Callable[[Sequence], None]) -> None:
        self._release = release  # the engine frees a held sequence's blocks
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.recompute_on_failure = config.kv_load_failure_policy == "recompute"
        self.host = host
        self.port = 0  # the side channel: the pod's HTTP port, known once it listens
        self._held: dict[str, tuple[Sequence, float]] = {}
        self._http: aiohttp.ClientSession | None = None

    def loadable(self, seq: Sequence) -> int:
        return 0  # pulled before the sequence is submitted (``pull``)

    def prefilled(self, seq: Sequence) -> None:
        pass

    # Producer

    def produced(self, seq: Sequence) -> dict[str, Any]:
        """The finished prefill leg's ``kv_transfer_params``, its blocks kept for the consumer."""
        self._expire()
        request_id = f"{seq.request_id}-{uuid.uuid4().hex[:8]}"  # the engine's own id: unique, whatever clients send
        self._held[request_id] = (seq, time.monotonic() + NIXL_LEASE_S)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[b.block_id for b in seq.blocks.blocks]], "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_host": self.host, "remote_port": self.port,
                "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": seq.prompt_len,
                "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": seq.cached_tokens}

    def read(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The side channel: a consumer pulls a held prefill's blocks, which are then freed."""
        self._expire()
        if request.get("remote_engine_id") != self.engine_id:
            return 409, {"engine_id": self.engine_id}
        held = self._held.pop(str(request.get("remote_request_id")), None)
        if held is None:
            return 404, {"engine_id": self.engine_id}
        self._release(held[0])
        return 200, {"engine_id": self.engine_id, "num_tokens": held[0].prompt_len}

    def restarted(self) -> None:
        """The engine restarted: what it held is gone, and it has a new engine id."""
        for seq, _ in self._held.values():
            self._release(seq)
        self._held.clear()
        self.engine_id = str(uuid.uuid4())

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, until) in self._held.items() if until <= now]:
            self._release(self._held.pop(request_id)[0])

    # Consumer

    async def pull(self, params: dict[str, Any], prompt_len: int) -> int:
        """Pull the prompt's blocks from the producer ``params`` name: the tokens now loadable."""
        fields = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        if not params.get("remote_block_ids") or not all(params.get(f) is not None for f in fields):
            log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
            return 0
        expected = params["remote_engine_id"]
        url = f"http://{params['remote_host']}:{params['remote_port']}{SIDE_CHANNEL_PATH}"
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            async with self._http.post(url, json={"remote_engine_id": expected,
                                                  "remote_request_id": params["remote_request_id"]}) as resp:
                status, answer = resp.status, await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KvLoadFailed(f"NIXL handshake with {url} failed: {exc}") from None
        if status == 409:
            raise KvLoadFailed(f"Remote NIXL agent engine ID mismatch. Expected {expected},"
                               f"received {answer.get('engine_id')}.")
        if status != 200:
            raise KvLoadFailed(f"the blocks of {params['remote_request_id']} are gone from {expected}")
        return prompt_len

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
