"""The peer routers the bench compares against, each run from the package its row names.

smg and sglang-router both install a console script named ``smg``: in one environment the last installed
wins, and a row named smg may run sglang-router. So each peer lives in its own virtual environment under
the user's cache, keyed by package, version and Python (``<cache>/peers/<package>-<version>-py<X.Y>``), and
before it runs its script is checked to be that package at that version: the environment's metadata must
give the pinned version, the script must belong to that package alone, and where the script prints its
version (``--version``) it must print that one. A peer that fails a check is refused (:class:`PeerRefused`);
one not installed is missing (:class:`PeerMissing`) until :func:`install_peer` puts it there.

Owner: nothing with a lifetime; the environments on disk, each made under its own lock and used only once
its ``.complete`` stamp is written (a half-made one is made again).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO

import msgspec


class PeerPackage(msgspec.Struct, frozen=True):
    """A peer router as the package index has it."""

    package: str  # its name on the package index
    version: str  # the pinned version the bench runs
    script: str  # the console script that starts it
    # What ``script --version`` prints before the version ("sgl-model-gateway 0.3.2"); none: no such flag.
    banner: str | None = None

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"


class PeerBinary(msgspec.Struct, frozen=True):
    """A peer's script, checked: the package and version it is, and what it says of itself."""

    package: str
    version: str
    path: str
    reported: str | None  # its ``--version`` line, where it has one


class PeerMissing(FileNotFoundError):
    """The peer's environment is not installed (or half made)."""


class PeerRefused(RuntimeError):
    """The peer's script is not the package and version its row claims."""


# Keyed by the contenders' kind (bench.runner.Contender.kind).
PEERS = {
    "vllm-router": PeerPackage("vllm-router", "0.1.17", "vllm-router"),
    "sglang-router": PeerPackage("sglang-router", "0.3.2", "smg", banner="sgl-model-gateway"),
    "smg": PeerPackage("smg", "1.13.0", "smg", banner="smg"),
}

# Run by the peer environment's own Python: the installed version of the package, and every distribution
# that declares the console script (more than one: whichever was installed last owns the file).
_METADATA = """
import importlib.metadata as m, json, sys
script, package = sys.argv[1:3]
owners = sorted({(d.metadata["Name"], d.version) for d in m.distributions()
                 for e in d.entry_points if e.group == "console_scripts" and e.name == script})
try:
    version = m.version(package)
except m.PackageNotFoundError:
    version = None
print(json.dumps({"version": version, "owners": owners}))
"""


def cache_root() -> Path:
    """Where environments installed once for every clone live (as ``tools/vllm-env.sh`` keeps real vLLM)."""
    if root := os.environ.get("KVGW_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kv-gateway"


def env_dir(peer: PeerPackage, root: Path | None = None) -> Path:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (root or cache_root()) / "peers" / f"{peer.package}-{peer.version}-py{py}"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve_peer(peer: PeerPackage, root: Path | None = None) -> PeerBinary:
    """The peer's script in its own environment, checked; :class:`PeerMissing` when it is not installed."""
    env = env_dir(peer, root)
    if not (env / ".complete").exists():
        raise PeerMissing(f"{peer.label} is not installed for the bench ({env}); `gateway bench` installs it "
                          "unless given --no-install-peers (make bench does)")
    return check_peer(peer, env / "bin" / peer.script, env / "bin" / "python")


def check_peer(peer: PeerPackage, script: Path, python: Path) -> PeerBinary:
    """``script`` (run by ``python``'s environment) is ``peer``'s, at its version, or :class:`PeerRefused`."""
    if not os.access(script, os.X_OK):
        raise PeerMissing(f"{script} is not an executable (expected {peer.label}'s {peer.script})")
    found = subprocess.run([str(python), "-c", _METADATA, peer.script, peer.package], capture_output=True,
                           text=True, timeout=60)
    if found.returncode != 0:
        raise PeerRefused(f"cannot read the packages of {python}: {found.stderr.strip()[-300:]}")
    metadata = json.loads(found.stdout)
    owners = [f"{name} {version}" for name, version in metadata["owners"]]
    refused = f"refused to run {script} as {peer.label}"
    if metadata["version"] != peer.version:
        raise PeerRefused(f"{refused}: its environment has {peer.package} {metadata['version'] or 'not installed'}")
    if [_normalized(name) for name, _ in metadata["owners"]] != [_normalized(peer.package)]:
        raise PeerRefused(f"{refused}: console script {peer.script} is installed by {', '.join(owners) or 'none'}"
                          " (the last installed owns the file)")
    reported = None
    if peer.banner is not None:
        said = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
        lines = (said.stdout.strip() or said.stderr.strip()).splitlines()
        reported = lines[0] if lines else ""
        if said.returncode != 0 or reported != f"{peer.banner} {peer.version}":
            raise PeerRefused(f"{refused}: `{peer.script} --version` prints {reported!r} (exit {said.returncode}),"
                              f" not '{peer.banner} {peer.version}'")
    return PeerBinary(peer.package, peer.version, str(script), reported)


def install_peer(peer: PeerPackage, root: Path | None = None, log: IO[str] | None = None) -> PeerBinary:
    """The peer, installed into its own environment first if it is not there (once; two installs at once
    share one), then checked."""
    env = env_dir(peer, root)
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{env}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env / ".complete").exists():
            print(f"bench: installing {peer.package}=={peer.version} into {env} (once)", file=log or sys.stderr)
            shutil.rmtree(env, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(env)], peer)
            _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  f"{peer.package}=={peer.version}"], peer)
            check_peer(peer, env / "bin" / peer.script, env / "bin" / "python")
            (env / ".complete").touch()
    return resolve_peer(peer, root)


def _run(cmd: list[str], peer: PeerPackage) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerMissing(f"cannot install {peer.label}: {' '.join(cmd[:4])} ... failed: "
                          f"{done.stderr.strip()[-500:]}")
