"""The README's client lines, and docs/clients.md's, run as written against the README's quick start.

tests/unit/test_readme.py checks that each block parses; here they run: the quick start's own ``gateway serve``
command (on a free port instead of 8080, which each line is pointed at), the README's Python blocks and curl
lines, and the lines for Claude Code and Codex where their binaries are found (``make install`` puts them in
``.tools/agents/``; else ``PATH``). docs/clients.md's lines run against the same pods with a key on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from simulator.pod import OUTPUT_TEXT
from tests.conftest import GatewayProcess, gateway_process
from tests.unit.test_readme import ROOT, SHELL, Block, fenced_blocks, hashed_keys, readme_blocks, shell_commands

CLIENTS_PAGE = ROOT / "docs" / "clients.md"
AGENT_BIN = ROOT / ".tools" / "agents" / "node_modules" / ".bin"
ANSWER = OUTPUT_TEXT.split(",")[0].strip()  # the first words every simulated answer starts with
TIMEOUT_S = 300  # a tool's run, on a loaded machine


def port_of(text: str, run: GatewayProcess) -> str:
    """``text`` pointed at the test's gateway instead of the documented port."""
    return re.sub(r"(localhost|127\.0\.0\.1):8080", run.url.removeprefix("http://"), text)


def commands(blocks: list[Block]) -> list[list[str]]:
    return [words for b in blocks if b.lang in SHELL and not (b.mark or "").startswith("skip")
            for words in shell_commands(b.text, b.lang == "console")]


def program(words: list[str]) -> str:
    """The command's program, past its leading ``NAME=value`` words."""
    return next((w for w in words if not re.fullmatch(r"[A-Za-z_]\w*=.*", w)), "")


def serve_args(blocks: list[Block]) -> list[str]:
    """The words after ``gateway serve`` of the first such command."""
    words = next(w for w in commands(blocks) if program(w) == "gateway" and "serve" in w)
    return words[words.index("serve") + 1:]


def tool(name: str) -> str | None:
    pinned = AGENT_BIN / name
    return str(pinned) if pinned.exists() else shutil.which(name)


def needs(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(tool(name) is None, reason=f"{name} is not installed: `make install` puts it in "
                              f"{AGENT_BIN.relative_to(ROOT)} (from the npm registry)")


def toml_block(page: list[Block]) -> str:
    return next(b.text for b in page if b.lang == "toml")


def tool_env(tmp: Path, run: GatewayProcess) -> dict[str, str]:
    """A home of its own for each tool (its sessions, Codex's config.toml in ``$CODEX_HOME``), the README's
    config pointed at the test's gateway, and nothing that lets a tool talk to anyone else."""
    (tmp / "codex").mkdir(exist_ok=True)
    (tmp / "codex" / "config.toml").write_text(port_of(toml_block(readme_blocks()), run))
    path = f"{AGENT_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "HOME": str(tmp), "CODEX_HOME": str(tmp / "codex"), "PATH": path,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def run_line(words: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """One command as a shell would run it: its leading ``NAME=value`` words are its environment."""
    env = dict(env)
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return subprocess.run(words, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def quick_start():
    with gateway_process(*serve_args(readme_blocks())) as run:
        yield run


@pytest.fixture(scope="module")
def keyed():
    """docs/clients.md's gateway: its ``export GATEWAY_*`` and ``gateway serve`` lines."""
    page = fenced_blocks(CLIENTS_PAGE.read_text(), "docs/clients.md")
    export = next(w for w in commands(page) if w[0] == "export" and any("GATEWAY_" in x for x in w))
    env = {n: hashed_keys(v) for n, _, v in (w.partition("=") for w in export[1:])}
    with gateway_process(*serve_args(page), env=env) as run:
        yield run


def test_the_quick_start_is_found():
    """The lines below are taken from the pages: each kind is there, so that the tests run something."""
    found = {program(w) for w in commands(readme_blocks())}
    assert {"gateway", "curl", "claude", "codex"} <= found
    assert serve_args(readme_blocks())[:2] == ["--mock-pods", "2"]
    assert "model_providers" in toml_block(readme_blocks())


@pytest.mark.parametrize("block", [b for b in readme_blocks() if b.lang == "python"], ids=str)
def test_readme_python_runs(quick_start, block, tmp_path):
    done = subprocess.run([sys.executable, "-c", port_of(block.text, quick_start)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, explain(done)
    assert done.stdout.strip(), "the block printed nothing"
    if "x-gateway-prefix-tokens" in block.text:  # what the quick start says its two lines show
        (pod1, cached1), (pod2, cached2) = (line.split() for line in done.stdout.splitlines())
        assert pod2 == pod1 and int(cached2) > int(cached1), done.stdout


@pytest.mark.parametrize("words", [w for w in commands(readme_blocks()) if program(w) == "curl"],
                         ids=lambda w: " ".join(w)[:60])
def test_readme_curl_runs(quick_start, words, tmp_path):
    line = [port_of(w, quick_start) for w in words] + ["-w", "\n%{http_code}"]
    done = run_line(line, dict(os.environ), tmp_path)
    body, _, status = done.stdout.rpartition("\n")
    assert done.returncode == 0 and status == "200", explain(done)
    assert body.strip()


@needs("claude")
def test_readme_claude_code_line(quick_start, tmp_path):
    words = next(w for w in commands(readme_blocks()) if program(w) == "claude")
    done = run_line([port_of(w, quick_start) for w in words], tool_env(tmp_path, quick_start), tmp_path)
    assert done.returncode == 0 and ANSWER in done.stdout, explain(done)


@needs("codex")
def test_readme_codex_line(quick_start, tmp_path):
    words = next(w for w in commands(readme_blocks()) if program(w) == "codex")
    done = run_line(words, tool_env(tmp_path, quick_start), tmp_path)
    assert done.returncode == 0 and ANSWER in done.stdout, explain(done)


def clients_page_lines(name: str) -> list[list[str]]:
    """docs/clients.md's lines for one tool, each with the ``export``s above it in its block put first."""
    out = []
    for block in fenced_blocks(CLIENTS_PAGE.read_text(), "docs/clients.md"):
        if block.lang not in SHELL:
            continue
        exported: list[str] = []
        for words in shell_commands(block.text, False):
            if words[0] == "export":
                exported += [w for w in words[1:] if not w.startswith("GATEWAY_AUTH")]
            elif program(words) == name:
                out.append(exported + words)
    return out


@needs("claude")
def test_clients_page_claude_code_with_a_key(keyed, tmp_path):
    """Both ways of sending the key, then a second turn that finds the first one's prompt cached."""
    lines = clients_page_lines("claude")
    assert len(lines) == 3
    env = tool_env(tmp_path, keyed)
    results = []
    for words in lines:
        done = run_line([port_of(w, keyed) for w in words], env, tmp_path)
        assert done.returncode == 0, explain(done)
        results.append(json.loads(done.stdout))
    assert all(not r["is_error"] and r["stop_reason"] == "end_turn" and ANSWER in r["result"] for r in results)
    assert results[2]["usage"]["cache_read_input_tokens"] > 0, results[2]


@needs("codex")
def test_clients_page_codex_with_a_key(keyed, tmp_path):
    """The README's config.toml, a second turn resumed; and the same keys given on the command line."""
    lines = clients_page_lines("codex")
    assert len(lines) == 3
    env = tool_env(tmp_path, keyed)
    (tmp_path / "bare").mkdir()
    for words in lines:
        # The line giving its keys with -c runs with no config.toml at all.
        home = {"CODEX_HOME": str(tmp_path / "bare")} if "-c" in words else {}
        done = run_line([port_of(w, keyed) for w in words], {**env, **home}, tmp_path)
        assert done.returncode == 0 and ANSWER in done.stdout, explain(done)


@needs("codex")
def test_a_wrong_key_is_refused(keyed, tmp_path):
    """The check can fail: the same line with a key the gateway does not know ends in its 401."""
    line = clients_page_lines("codex")[0]
    at = line.index(program(line))
    key = tomllib.loads(toml_block(readme_blocks()))["model_providers"]["gateway"]["env_key"]
    words = [*line[:at], f"{key}=wrong", *line[at:]]
    done = run_line(words, tool_env(tmp_path, keyed), tmp_path)
    assert done.returncode != 0 and "401" in done.stdout + done.stderr, explain(done)
