"""``kubernetes``: inference pods found through the Kubernetes API (list, then watch), by label selector.

Plain HTTPS with the service account's token: no client library. Only ready pods (Running, Ready
condition true, an IP, not terminating) are routed to. Per pod, annotations say where things are:

    gateway.kv/http-port (default 8000), gateway.kv/kv-events-port, gateway.kv/kv-replay-port,
    gateway.kv/model, gateway.kv/dp-size, gateway.kv/flavor (vllm|sglang), gateway.kv/topic,
    gateway.kv/role (prefill|decode|both: the legs of a disaggregated request it serves; default both)

Options: ``label_selector`` (required; for ``gateway epp``, the InferencePool's selector), ``namespace``
(default: the service account's), ``http_port`` (the pods' port when no annotation says it: the
InferencePool's target port; default 8000), ``api_server`` (default https://kubernetes.default.svc),
``token_path``, ``ca_path``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import orjson

from gateway.plugin_api import DiscoveryContext, PluginSpec, PodConfig

log = logging.getLogger("gateway.discovery.kubernetes")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PREFIX = "gateway.kv/"


def pod_config(obj: dict[str, Any], http_port: int = 8000) -> PodConfig | None:
    """The gateway's view of a Kubernetes pod object, or None when it should get no traffic."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ip or not ready or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return None
    notes = {k[len(PREFIX):]: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(PREFIX)}
    events, replay = notes.get("kv-events-port"), notes.get("kv-replay-port")
    try:
        return PodConfig(
            url=f"http://{ip}:{int(notes.get('http-port', http_port))}",
            name=meta.get("name") or ip,
            models=[notes["model"]] if notes.get("model") else [],
            flavor=notes.get("flavor", "vllm"),  # type: ignore[arg-type]
            kv_events=f"tcp://{ip}:{int(events)}" if events else None,
            kv_replay=f"tcp://{ip}:{int(replay)}" if replay else None,
            kv_topic=notes.get("topic", ""),
            dp_size=int(notes.get("dp-size", 1)),
            role=notes.get("role", "both"),  # type: ignore[arg-type]
        )
    except (ValueError, TypeError) as exc:
        log.warning("pod %s has unusable gateway.kv/ annotations: %s", meta.get("name"), exc)
        return None


class KubernetesSource:
    name = "kubernetes"

    def __init__(self, api_server: str, namespace: str, label_selector: str, token: str | None,
                 ssl_context: ssl.SSLContext | None, retry_s: float = 2.0, http_port: int = 8000) -> None:
        self._base = f"{api_server.rstrip('/')}/api/v1/namespaces/{namespace}/pods"
        self._selector = label_selector
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl = ssl_context
        self._retry_s = retry_s
        self._http_port = http_port

    async def watch(self) -> AsyncIterator[list[PodConfig]]:
        pods: dict[str, PodConfig] = {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)
        async with aiohttp.ClientSession(headers=self._headers, timeout=timeout) as http:
            while True:
                try:
                    version = await self._list(http, pods)
                    yield sorted(pods.values(), key=lambda p: p.name or "")
                    async for changed in self._follow(http, pods, version):
                        if changed:
                            yield sorted(pods.values(), key=lambda p: p.name or "")
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                    log.warning("Kubernetes pod watch interrupted (%s); listing again in %.0f s", exc, self._retry_s)
                await asyncio.sleep(self._retry_s)

    async def _list(self, http: aiohttp.ClientSession, pods: dict[str, PodConfig]) -> str:
        async with http.get(self._base, params={"labelSelector": self._selector}, ssl=self._ssl) as resp:
            resp.raise_for_status()
            body = orjson.loads(await resp.read())
        pods.clear()
        for item in body.get("items") or []:
            cfg = pod_config(item, self._http_port)
            if cfg is not None:
                pods[cfg.name or ""] = cfg
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _follow(self, http: aiohttp.ClientSession, pods: dict[str, PodConfig],
                      version: str) -> AsyncIterator[bool]:
        params = {"labelSelector": self._selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true"}
        async with http.get(self._base, params=params, ssl=self._ssl) as resp:
            resp.raise_for_status()
            async for line in resp.content:  # one JSON watch event per line
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old, list again
                    raise ValueError(f"watch error: {obj.get('message', obj)}")
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                name = (obj.get("metadata") or {}).get("name", "")
                cfg = None if kind == "DELETED" else pod_config(obj, self._http_port)
                before = pods.get(name)
                if cfg is None:
                    pods.pop(name, None)
                else:
                    pods[name] = cfg
                yield before != cfg


class KubernetesOptions(msgspec.Struct, forbid_unknown_fields=True):
    label_selector: str
    namespace: str | None = None  # default: the gateway's own (from its service account)
    http_port: int = 8000  # the pods' HTTP port when no gateway.kv/http-port annotation says it
    api_server: str = "https://kubernetes.default.svc"
    token_path: str = str(SA_DIR / "token")
    ca_path: str = str(SA_DIR / "ca.crt")


def build(context: DiscoveryContext, options: KubernetesOptions) -> KubernetesSource:
    token_path, ca_path, api = Path(options.token_path), Path(options.ca_path), options.api_server
    namespace = options.namespace or (SA_DIR / "namespace").read_text().strip()
    context_ssl = ssl.create_default_context(cafile=str(ca_path)) if api.startswith("https") and ca_path.exists() \
        else None
    token = token_path.read_text().strip() if token_path.exists() else None
    return KubernetesSource(api, namespace, options.label_selector, token, context_ssl, http_port=options.http_port)


PLUGIN = PluginSpec(KubernetesOptions, build)
