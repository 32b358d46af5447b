"""The simulator and the benchmark plug into the ``gateway`` command through entry points; where one is not
installed, the gateway names the extra that brings it."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from gateway import extensions
from gateway.cli import build_parser, main
from gateway.config import ConfigError, load_config
from gateway.extensions import COMMAND_GROUP, SIMULATOR_GROUP, missing_package


class FakeDistribution:
    def __init__(self, requires: list[str]) -> None:
        self.requires = requires


def entry(name: str, value: str, group: str, requires: list[str] | None = None) -> EntryPoint:
    point = EntryPoint(name, value, group)
    return point._for(FakeDistribution(requires)) if requires is not None else point


def test_the_installed_packages_bring_their_commands_and_the_mock_pods_section():
    installed, missing = extensions.commands()
    assert {"mock", "bench"} <= set(installed) and not missing
    assert installed["bench"].help in build_parser().format_help()
    config = load_config(overrides={"mock_pods": {"count": 2}}, environ={"GATEWAY_MOCK_PODS__SPEED": "0"})
    assert type(config.mock_pods).__module__ == "simulator.config"  # the simulator's struct, its defaults
    assert (config.mock_pods.count, config.mock_pods.speed, config.mock_pods.block_size) == (2, 0.0, 16)
    assert load_config(environ={}).mock_pods is None  # no section: no simulated pods


def test_a_package_counts_as_missing_without_its_module_or_its_extras_requirements():
    assert missing_package(entry("mock", "simulator.cli:COMMAND", COMMAND_GROUP, [])) is None
    assert missing_package(entry("x", "nosuchpackage.cli:COMMAND", COMMAND_GROUP)) == "nosuchpackage"
    needs = ['tqdm>=4.66; extra == "bench"', "no-such-dependency-xyz>=1; extra == 'other'"]
    assert missing_package(entry("bench", "bench.cli:COMMAND", COMMAND_GROUP, needs)) is None
    needs.append('no-such-dependency-xyz>=1; extra == "bench"')
    assert missing_package(entry("bench", "bench.cli:COMMAND", COMMAND_GROUP, needs)) == "bench"


@pytest.fixture
def nothing_beside_the_runtime(monkeypatch):
    """As in the gateway's image: the entry points are declared, their packages are not there."""
    points = {COMMAND_GROUP: [entry("mock", "nosim.cli:COMMAND", COMMAND_GROUP),
                              entry("bench", "nobench.cli:COMMAND", COMMAND_GROUP)],
              SIMULATOR_GROUP: [entry("pods", "nosim.cli:SIMULATOR", SIMULATOR_GROUP)]}
    monkeypatch.setattr(extensions, "entry_points", lambda group: points[group])
    monkeypatch.setattr("gateway.cli.configure_logging_early", lambda: None)  # the test process's logging stays


def test_without_the_packages_help_and_each_command_say_how_to_install_them(nothing_beside_the_runtime, capsys):
    help_text = " ".join(build_parser().format_help().split())
    assert "mock (not installed: pip install 'kv-gateway[nosim]')" in help_text
    assert "bench (not installed: pip install 'kv-gateway[nobench]')" in help_text
    assert main(["bench", "--scenario", "agentic"]) == 2
    assert "gateway bench needs the nobench package: pip install 'kv-gateway[nobench]'" in capsys.readouterr().err


def test_without_the_simulator_mock_pods_name_the_extra(nothing_beside_the_runtime, capsys):
    needs = r"mock_pods: this section needs the nosim package: pip install 'kv-gateway\[nosim\]'"
    with pytest.raises(ConfigError, match=needs):
        load_config(overrides={"mock_pods": {"count": 1}}, environ={})
    assert load_config(overrides={"pods": [{"url": "http://a:1"}]}, environ={}).mock_pods is None
    assert main(["serve", "--mock-pods", "2"]) == 2
    assert "pip install 'kv-gateway[nosim]'" in capsys.readouterr().err
