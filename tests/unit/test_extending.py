"""docs/extending.md's worked examples hold: its example kit, composed with the shipped kits as
``build_gateway`` composes them, serves its route and takes its section when the file is read again; its
route and config-option examples are the shipped code."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from textwrap import indent
from typing import Any

import msgspec
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.api.routes import check_admin
from gateway.app import Assembly, build_app, build_gateway
from gateway.config import ConfigSource, GatewayConfig, file_digest
from gateway.kits.foundation import Foundation
from gateway.kits.kit import Apply, Kit, Route
from gateway.kits.serving import ReloadKit

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/extending.md").read_text()


def block(lang: str, holding: str) -> str:
    """The page's first ``lang`` block that holds ``holding``."""
    return next(b for b in re.findall(rf"^```{lang}\n(.*?)^```", PAGE, flags=re.S | re.M) if holding in b)


def example() -> dict[str, Any]:
    """The page's config Struct and kit, run with what their files would import."""
    names: dict[str, Any] = {"msgspec": msgspec, "web": web, "Iterable": Iterable, "Mapping": Mapping,
                             "Kit": Kit, "Route": Route, "Apply": Apply, "Foundation": Foundation,
                             "check_admin": check_admin}
    for code in (block("python", "class NoticeConfig"), block("python", "class NoticeKit")):
        exec(compile(code, "docs/extending.md", "exec", dont_inherit=True), names)
    return names


EXAMPLE = example()
NoticeConfig, NoticeKit = EXAMPLE["NoticeConfig"], EXAMPLE["NoticeKit"]
# GatewayConfig with the example's section, as the page adds it.
WithNotice = msgspec.defstruct("WithNotice", [("notice", NoticeConfig, msgspec.field(default_factory=NoticeConfig))],
                               bases=(GatewayConfig,))


@dataclass(frozen=True, eq=False)
class WithNoticeKit(Assembly):
    """The shipped kits and the example's: a field more, as the page adds it to ``Assembly``."""

    notice: Any


class NoticeSource(ConfigSource, frozen=True):
    """A config file read into ``WithNotice`` (the shipped ``GatewayConfig`` has no ``notice``)."""

    def reread(self) -> NoticeSource:
        return NoticeSource(self.path, self.overrides, load(Path(self.path).read_text()), file_digest(self.path))


def load(text: str) -> Any:
    return msgspec.convert(yaml.safe_load(text), WithNotice)


async def test_the_example_kit_composes_with_the_shipped_ones_serves_its_route_and_reloads_its_section(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(block("yaml", "notice:"))
    source = NoticeSource(str(path), {}, load(path.read_text()), file_digest(str(path)))
    config = source.loaded
    shipped = build_gateway(config)
    notice = NoticeKit(config.notice, shipped.foundation)  # build_gateway: the build line
    kits = (*shipped.kits[:-1], notice)  # ... and one more name in ``kits``
    gateway = WithNoticeKit(*kits[:-1], ReloadKit(config, source, kits, shipped.foundation), notice)
    assert [f.name for f in fields(gateway)][-2:] == ["reload", "notice"] and gateway.kits[-1] is notice
    assert "notice" in gateway.reload.requires  # it reloads a section: the reloader starts after it

    async with TestClient(TestServer(build_app(gateway))) as client:
        page = await client.get("/debug/notice")
        assert await page.json() == {"notice": "maintenance at 22:00 UTC: expect a restart"}
        path.write_text("notice:\n  text: done\n")
        gateway.reload.reloader.request()  # as SIGHUP does
        for _ in range(200):
            if (await (await client.get("/debug/notice")).json()) == {"notice": "done"}:
                break
            await asyncio.sleep(0.01)
        assert (await (await client.get("/debug/notice")).json()) == {"notice": "done"}


def test_the_route_and_option_examples_are_the_shipped_code():
    kit = (ROOT / "gateway/kits/flow.py").read_text()
    assert indent(block("python", '"/debug/flows"'), "    ") in kit  # a method of FlowKit
    assert "self._page = partial(debug.flows_page, base.auth, fc.enabled, self.flow)" in kit and \
        "`self._page = partial(debug.flows_page, base.auth, fc.enabled, self.flow)`" in PAGE
    assert block("python", "async def flows_page") in (ROOT / "gateway/api/debug.py").read_text()
    assert indent(block("python", "client_stall_s: float"), "    ") in (ROOT / "gateway/config/process.py").read_text()
    option = yaml.safe_load(block("yaml", "client_stall_s:"))
    assert msgspec.convert(option, GatewayConfig).server.client_stall_s == 10
    assert "    kits = (" in (ROOT / "gateway/app.py").read_text()  # where a new kit joins the others
