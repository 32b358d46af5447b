"""Each peer contender runs the package its row names, at its pinned version, or is refused.

The environments here are real virtual environments (``python -m venv``) holding fake distributions: their
metadata (``*.dist-info``) and a console script that prints what a real one would. The checks read them
as they read an installed peer: the environment's own Python lists its packages, the script is run.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import (
    PEERS,
    PeerMissing,
    PeerPackage,
    PeerRefused,
    cache_root,
    env_dir,
    resolve_peer,
)
from bench.runner import CONTENDERS

SMG, SGLANG_ROUTER, VLLM_ROUTER = PEERS["smg"], PEERS["sglang-router"], PEERS["vllm-router"]


def fake_env(root: Path, peer: PeerPackage, distributions: list[tuple[str, str]], says: str | None,
             complete: bool = True) -> Path:
    """A real environment where ``peer`` is expected, holding ``distributions`` (name, version), each
    declaring ``peer.script``, and that script printing ``says`` for ``--version``."""
    env = env_dir(peer, root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for name, version in distributions:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[console_scripts]\n{peer.script} = {name.replace('-', '_')}:main\n")
    script = env / "bin" / peer.script
    script.write_text(f"#!/bin/sh\necho '{says}'\n" if says is not None else "#!/bin/sh\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    if complete:
        (env / ".complete").touch()
    return env


def test_smg_whose_script_is_sglang_routers_is_refused(tmp_path):
    # The case: the script named smg prints sglang-router's banner.
    fake_env(tmp_path, SMG, [("smg", "1.13.0")], says="sgl-model-gateway 0.3.2")
    with pytest.raises(PeerRefused, match=r"smg --version` prints 'sgl-model-gateway 0\.3\.2'.*not 'smg 1\.13\.0'"):
        resolve_peer(SMG, tmp_path)


def test_the_right_smg_and_sglang_router_resolve_to_their_own_scripts(tmp_path):
    smg_env = fake_env(tmp_path, SMG, [("smg", "1.13.0")], says="smg 1.13.0")
    sglang_env = fake_env(tmp_path, SGLANG_ROUTER, [("sglang-router", "0.3.2")], says="sgl-model-gateway 0.3.2")
    smg, sglang = resolve_peer(SMG, tmp_path), resolve_peer(SGLANG_ROUTER, tmp_path)
    assert (smg.package, smg.version, smg.reported) == ("smg", "1.13.0", "smg 1.13.0")
    assert smg.path == str(smg_env / "bin" / "smg")
    assert (sglang.package, sglang.version, sglang.reported) == ("sglang-router", "0.3.2", "sgl-model-gateway 0.3.2")
    assert sglang.path == str(sglang_env / "bin" / "smg") != smg.path


def test_a_script_two_packages_install_is_refused(tmp_path):
    # Both installed in one environment: whichever came last owns bin/smg, so neither row can trust it.
    fake_env(tmp_path, SMG, [("smg", "1.13.0"), ("sglang-router", "0.3.2")], says="smg 1.13.0")
    with pytest.raises(PeerRefused, match=r"console script smg is installed by sglang-router 0\.3\.2, smg 1\.13\.0"):
        resolve_peer(SMG, tmp_path)


def test_another_version_of_the_package_is_refused(tmp_path):
    # vllm-router has no --version: its environment's metadata says which it is.
    fake_env(tmp_path, VLLM_ROUTER, [("vllm-router", "0.1.16")], says=None)
    with pytest.raises(PeerRefused, match=r"its environment has vllm-router 0\.1\.16"):
        resolve_peer(VLLM_ROUTER, tmp_path)
    fake_env(tmp_path / "other", VLLM_ROUTER, [("vllm-router", "0.1.17")], says=None)
    assert resolve_peer(VLLM_ROUTER, tmp_path / "other").reported is None


def test_a_script_that_fails_its_version_flag_is_refused(tmp_path):
    fake_env(tmp_path, SMG, [("smg", "1.13.0")], says=None)
    with pytest.raises(PeerRefused, match=r"prints '' \(exit 2\)"):
        resolve_peer(SMG, tmp_path)


def test_a_missing_or_half_made_environment_is_missing(tmp_path):
    with pytest.raises(PeerMissing, match=r"smg 1\.13\.0 is not installed for the bench"):
        resolve_peer(SMG, tmp_path)
    fake_env(tmp_path, SMG, [("smg", "1.13.0")], says="smg 1.13.0", complete=False)
    with pytest.raises(PeerMissing):
        resolve_peer(SMG, tmp_path)


def test_no_two_peer_contenders_resolve_to_the_same_binary():
    """Each peer row names its package (its kind), and distinct packages live in distinct environments,
    so smg's and sglang-router's scripts, both named smg, are two files."""
    rows = [c for c in CONTENDERS.values() if c.kind not in ("direct", "gateway", "envoy-epp")]  # ours, not peers
    assert {c.kind for c in rows} == set(PEERS)
    binaries = {kind: env_dir(peer) / "bin" / peer.script for kind, peer in PEERS.items()}
    assert len(set(binaries.values())) == len(PEERS)
    assert binaries["smg"] != binaries["sglang-router"] and binaries["smg"].name == binaries["sglang-router"].name
    for c in rows:
        assert c.name.startswith(PEERS[c.kind].package + "-"), c.name


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGW_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path and env_dir(SMG).parent == tmp_path / "peers"
    monkeypatch.delenv("KVGW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kv-gateway"


@pytest.mark.parametrize("kind", sorted(PEERS))
def test_installed_peers_are_what_they_claim(kind):
    """The real environments, where this machine has installed them (`make bench` does)."""
    peer = PEERS[kind]
    if not (env_dir(peer) / ".complete").exists():
        pytest.skip(f"{peer.label} is not installed here")
    binary = resolve_peer(peer)
    assert (binary.package, binary.version) == (peer.package, peer.version)
    assert binary.reported == (f"{peer.banner} {peer.version}" if peer.banner else None)
