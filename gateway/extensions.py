"""What the packages installed beside the runtime add to it, found through entry points as the plugins are,
so the runtime never imports them.

- ``gateway.commands``: subcommands of ``gateway`` (``mock`` from the simulator, ``bench`` from the
  benchmark), each entry point a :class:`Command`.
- ``gateway.simulator``: the simulated pods that ``gateway serve`` starts beside itself when the config's
  ``mock_pods`` section asks for them, its entry point a :class:`Simulator`.

This repository's packages (``simulator``, ``bench``) each come with the extra of the same name
(``pip install 'kv-gateway[bench]'``): a package counts as installed when it imports and its extra's
requirements are there; where it does not, the gateway says which extra brings it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from importlib.util import find_spec
from typing import Any, Protocol

import msgspec

COMMAND_GROUP = "gateway.commands"
SIMULATOR_GROUP = "gateway.simulator"
SIMULATOR_PACKAGE = "simulator"


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # the exit status


class SimulatedPods(Protocol):
    async def started(self) -> None:
        """Once every pod listens; raises when one exits or does not start in time."""
        ...

    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Simulator:
    # The ``mock_pods`` section: :class:`gateway.config.GatewayConfig` decodes it into this struct.
    section: type[msgspec.Struct]
    # Start the pods the section asks for; give back the config with them added (the gateway may start while
    # they do), and the pods to wait for and to stop.
    start: Callable[[Any], Awaitable[tuple[Any, SimulatedPods]]]


class NotInstalled(LookupError):
    def __init__(self, what: str, package: str) -> None:
        super().__init__(f"{what} needs the {package} package: pip install 'kv-gateway[{package}]'")
        self.package = package


def missing_package(entry: EntryPoint) -> str | None:
    """The package (and extra) an entry point lacks: its module's top package when that is absent or a
    requirement of its extra is not installed; None when it is all there."""
    package = entry.module.partition(".")[0]
    if find_spec(package) is None:
        return package
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(package)}["']""")
    for requirement in (entry.dist.requires or []) if entry.dist else []:
        name, _, markers = requirement.partition(";")
        if marker.search(markers):
            try:
                version(re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0])
            except PackageNotFoundError:
                return package
    return None


def commands() -> tuple[dict[str, Command], dict[str, str]]:
    """The installed commands by name, and the package each command that is not installed needs."""
    found: dict[str, Command] = {}
    missing: dict[str, str] = {}
    for entry in entry_points(group=COMMAND_GROUP):
        package = missing_package(entry)
        if package:
            missing[entry.name] = package
        else:
            found[entry.name] = entry.load()
    return found, missing


def simulator(what: str) -> Simulator:
    """The simulator, or :class:`NotInstalled` saying which extra brings it for ``what``."""
    for entry in entry_points(group=SIMULATOR_GROUP):
        package = missing_package(entry)
        if package:
            raise NotInstalled(what, package)
        return entry.load()
    raise NotInstalled(what, SIMULATOR_PACKAGE)
