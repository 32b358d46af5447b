"""``file``: pods listed in a YAML or JSON file (``pods: [{url: ..., kv_events: ...}]``), reloaded when
the file changes. Options: ``path``, ``interval_s`` (default 1). A file that does not parse or validate
is reported and ignored: the last good pod set stays."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from gateway.plugin_api import ConfigError, DiscoveryContext, PluginSpec, PodConfig, read_config_file

log = logging.getLogger("gateway.discovery.file")


class FileSource:
    name = "file"

    def __init__(self, path: str, interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.interval_s = interval_s

    def _read(self) -> list[PodConfig]:
        data = read_config_file(self.path)
        return msgspec.convert(data.get("pods", []), list[PodConfig], strict=False)

    async def watch(self) -> AsyncIterator[list[PodConfig]]:
        seen: tuple[float, int] | None = None
        while True:
            try:
                stat = os.stat(self.path)
                stamp = (stat.st_mtime, stat.st_size)
                if stamp != seen:
                    seen = stamp
                    yield await asyncio.to_thread(self._read)
            except (OSError, ConfigError, msgspec.ValidationError) as exc:
                log.warning("pod file %s unusable, keeping the current pods: %s", self.path, exc)
            await asyncio.sleep(self.interval_s)


class FileOptions(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    interval_s: float = 1.0


def build(context: DiscoveryContext, options: FileOptions) -> FileSource:
    return FileSource(options.path, options.interval_s)


PLUGIN = PluginSpec(FileOptions, build)
