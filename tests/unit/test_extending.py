"""docs/extending.md's worked examples hold: its example kit, installed as its file and entry point line,
runs when the config names it, serves its route and takes its options again when the file is read again; its
route and config-option examples are the shipped code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from textwrap import indent

import msgspec
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import build_app, build_gateway, effective_plugin_options
from gateway.cli import check_config
from gateway.config import ConfigSource, GatewayConfig
from gateway.plugin_registry import PluginOptionsError, UnknownPlugin

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/extending.md").read_text()


def block(lang: str, holding: str) -> str:
    """The page's first ``lang`` block that holds ``holding``."""
    return next(b for b in re.findall(rf"^```{lang}\n(.*?)^```", PAGE, flags=re.S | re.M) if holding in b)


def install(folder: Path) -> None:
    """The page's kit file and entry point, in ``folder`` as a package of its own installs them."""
    (folder / "notice_kit.py").write_text(block("python", "class NoticeKit"))
    groups = tomllib.loads(block("toml", '"gateway.kits"'))["project"]["entry-points"]
    info = folder / "notice_kit-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: notice-kit\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
        for group, points in groups.items()))


async def test_the_example_kit_installed_runs_serves_its_route_and_takes_its_options_again(tmp_path, monkeypatch):
    install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "gateway.yaml"
    path.write_text(block("yaml", "kits:"))
    source = ConfigSource.read(str(path))
    gateway = build_gateway(source.loaded, source=source)
    notice = gateway.addons[0]
    assert [kit.name for kit in gateway.addons] == ["notice"] and type(notice.kit).__name__ == "NoticeKit"
    assert notice in gateway.kits and "notice" in gateway.reload.requires  # the reloader starts after it

    async with TestClient(TestServer(build_app(gateway))) as client:
        async def page() -> dict[str, str]:
            return await (await client.get("/debug/notice")).json()

        assert await page() == {"notice": "maintenance at 22:00 UTC: expect a restart"}
        path.write_text("kits:\n  notice:\n    text: done\n")
        assert await gateway.reload.reloader.reload() == "applied"
        assert await page() == {"notice": "done"}
        for refused in ("kits:\n  notice: {text: x}\n  other: {}\n", "kits: {}\n", "kits:\n  notice: {txt: x}\n"):
            path.write_text(refused)  # a kit added, one removed, an option it lacks
            assert await gateway.reload.reloader.reload() == "invalid"
        assert await page() == {"notice": "done"}


def test_an_unknown_kit_or_option_stops_the_start_naming_it(tmp_path, monkeypatch):
    install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownPlugin, match="unknown kit 'noticeboard'; known: notice"):
        build_gateway(msgspec.convert({"kits": {"noticeboard": {}}}, GatewayConfig))
    with pytest.raises(PluginOptionsError, match=r"kit 'notice': bad options: .*txt"):
        effective_plugin_options(msgspec.convert({"kits": {"notice": {"txt": "x"}}}, GatewayConfig))


def test_config_check_prints_each_kit_with_its_options_and_their_defaults(tmp_path, monkeypatch, capsys):
    install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "gateway.yaml"
    path.write_text("pods: [{url: 'http://127.0.0.1:9'}]\nkits:\n  notice: {}\n")
    assert check_config(str(path), as_json=False) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kits"] == {"notice": {"text": ""}}
    path.write_text("kits:\n  notice: {txt: x}\n")
    assert check_config(str(path), as_json=False) == 2
    assert "kit 'notice': bad options" in capsys.readouterr().err


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
