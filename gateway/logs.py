"""Logging set-up: plain text or one JSON object per line, and the per-request access record."""

from __future__ import annotations

import logging
import sys
import time

import orjson

from gateway.config import LoggingConfig

ACCESS_LOGGER = "gateway.access"
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.converter = time.gmtime


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs a traceback for every request it cannot parse (bad header bytes, HTTP/2 prefaces):
    a client's mistake, so one warning line without the traceback is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!s}".replace("\n", " ")[:300]
            record.args = ()
            record.exc_info = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_logging(config: LoggingConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.level.upper())
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if config.access_log else logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestFilter())
