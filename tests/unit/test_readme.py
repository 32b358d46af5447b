"""The README's commands and config blocks, checked as written; and those of the pages in docs/.

Every fenced block of README.md is read by its language (and so is every block of docs/*.md that names
one; a block without a language there is a diagram):

- ``yaml``: a fragment of the gateway's config, merged into the defaults and validated by
  :func:`gateway.config.load_config` with each named plugin's options (as ``gateway config check`` does); or,
  marked ``<!-- readme-test: helm-values -->`` on the line before, a Helm values file whose keys must be
  those of ``charts/gateway/values.yaml`` (its ``config`` a gateway config fragment, its pods real pods);
- ``sh``, ``bash``, ``console``: each ``gateway ...`` command parses with the CLI's own parser, and the config
  its flags and ``GATEWAY_*`` variables make is valid; each ``make X`` names a Makefile target; each ``curl``
  to the gateway uses its documented port, a route it serves and a body that is JSON; each ``pip install``
  names extras that ``pyproject.toml`` defines; each path into the repository exists;
- ``python``: compiles, and talks to the gateway on its documented port;
- ``toml``: a Codex ``config.toml`` that Codex takes: a ``model``, and providers with each key it needs.

tests/integration/test_readme_runs.py runs the README's client lines against its quick start.

A block marked ``<!-- readme-test: skip (why) -->`` is left out. Beside the blocks: links and their anchors
resolve, each ``GET /path`` or ``POST /path`` is a route of the gateway, each ``gateway_*`` metric exists,
and the page stays a user's page (at most 450 lines, a table of contents, no commit hashes or issue
history). The tests at the end break each rule once, to show that the checks can fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from gateway.app import build_app, build_gateway, effective_plugin_options
from gateway.cli import build_parser, policy_names, serve_overrides
from gateway.config import ConfigError, GatewayConfig, ServerConfig, env_overrides, hash_api_key, load_config
from gateway.plugin_registry import PluginOptionsError, UnknownPlugin

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 450
PORT = ServerConfig().port  # the port the README documents: the gateway's default
SHELL = {"sh", "bash", "console", "shell"}
# Paths into the repository that a command may name; each must exist.
REPO_DIRS = ("charts/", "bench/", "simulator/", "tools/", "tests/", "docs/", "profiles/", ".ci/")
# Values of charts/gateway/values.yaml whose keys are the user's own.
HELM_FREE = {"config", "epp.inferencePool.selector", "resources", "podAnnotations", "nodeSelector", "affinity"}


class ReadmeError(Exception):
    """What the README says does not hold."""


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    mark: str | None  # the ``readme-test`` directive on the line before the fence
    page: str = "README.md"

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def fenced_blocks(text: str, page: str = "README.md") -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.fullmatch(r"```(\S*)\s*", lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ReadmeError(f"{page}:{i + 1}: a fence that is never closed")
        mark = re.fullmatch(r"<!-- readme-test: (.+?) -->", lines[i - 1].strip()) if i else None
        blocks.append(Block(opening[1].lower(), "\n".join(lines[i + 1:end]), i + 1, mark[1] if mark else None,
                            page))
        i = end + 1
    return blocks


def prose(text: str) -> str:
    """The README without its fenced blocks."""
    return re.sub(r"^```.*?^```\s*$", "", text, flags=re.S | re.M)


# --- config and Helm values -------------------------------------------------------------------------------


def check_config_fragment(data: object, where: str, environ: dict[str, str] | None = None) -> None:
    if not isinstance(data, dict):
        raise ReadmeError(f"{where}: a config fragment must be a mapping of sections, not {type(data).__name__}")
    try:
        config = load_config(overrides=data, environ=environ or {})
        effective_plugin_options(config)
    except (ConfigError, PluginOptionsError, UnknownPlugin) as exc:
        raise ReadmeError(f"{where}: {exc}") from exc


@cache
def helm_defaults() -> dict:
    return yaml.safe_load((ROOT / "charts/gateway/values.yaml").read_text())


def check_helm_values(data: object, where: str, defaults: dict | None = None, path: str = "") -> None:
    defaults = helm_defaults() if defaults is None else defaults
    if not isinstance(data, dict):
        raise ReadmeError(f"{where}: {path or 'the values'} must be a mapping")
    for key, value in data.items():
        name = f"{path}{key}"
        if key not in defaults:
            raise ReadmeError(f"{where}: {name} is not a value of charts/gateway/values.yaml")
        if name == "config":
            check_config_fragment(value, f"{where} (config)")
        elif name == "pods.list":
            check_config_fragment({"pods": value}, f"{where} (pods.list)")
        elif isinstance(defaults[key], dict) and name not in HELM_FREE:
            check_helm_values(value, where, defaults[key], f"{name}.")


def check_yaml(block: Block) -> None:
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        raise ReadmeError(f"{block}: not YAML: {exc}") from exc
    if block.mark == "helm-values":
        check_helm_values(data, str(block))
    else:
        check_config_fragment(data, str(block))


# --- shell commands ---------------------------------------------------------------------------------------


def shell_commands(text: str, console: bool) -> list[list[str]]:
    """Each command of a shell block as its words: lines joined where they end in a backslash, comments
    dropped, split at ``;``, ``&&``, ``||`` and ``|``; in a console block only the lines after ``$ ``."""
    logical, pending = [], None
    for line in text.splitlines():
        if console and pending is None:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        joined = line if pending is None else pending + " " + line
        if joined.rstrip().endswith("\\"):
            pending = joined.rstrip()[:-1]
            continue
        logical.append(joined)
        pending = None
    commands = []
    for line in logical:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in {";", "&&", "||", "|", "&"}:
                commands.append(words)
                words = []
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, flags=re.M))


@cache
def extras() -> frozenset[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return frozenset(project.get("optional-dependencies", {}))


@cache
def served_routes() -> tuple[tuple[str, re.Pattern[str]], ...]:
    """(method, path pattern) of every route the gateway's HTTP server adds."""
    app = build_app(build_gateway(GatewayConfig()))  # built, never started: each kit adds its routes
    routes = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        template = info.get("path") or info.get("formatter") or ""
        pattern = re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(template))
        routes.append((route.method, re.compile(pattern)))
    return tuple(routes)


def check_route(method: str, path: str, where: str) -> None:
    path = re.sub(r"\{\w+\}", "x", path.split("?", 1)[0])
    if not any(m == method and p.fullmatch(path) for m, p in served_routes()):
        raise ReadmeError(f"{where}: the gateway serves no {method} {path}")


def check_gateway_command(words: list[str], environ: dict[str, str], where: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(words)
    except SystemExit as exc:
        if exc.code == 0:  # --version, --help
            return
        raise ReadmeError(f"{where}: gateway {' '.join(words)}: {err.getvalue().strip()}") from None
    if args.command in ("serve", "epp"):
        if args.policy and args.policy not in policy_names():
            raise ReadmeError(f"{where}: no routing policy {args.policy!r}; there are {policy_names()}")
        try:
            overrides = serve_overrides(args)
        except ConfigError as exc:
            raise ReadmeError(f"{where}: {exc}") from exc
        check_config_fragment(overrides, where, environ)


def check_curl(words: list[str], where: str) -> None:
    method = "GET"
    for i, word in enumerate(words):
        if word in ("-d", "--data", "--data-raw", "--json") and i + 1 < len(words):
            method = "POST"
            body = words[i + 1]
            if body.startswith(("{", "[")):
                try:
                    json.loads(body)
                except json.JSONDecodeError as exc:
                    raise ReadmeError(f"{where}: curl's body is not JSON: {exc}") from exc
        elif word in ("-X", "--request") and i + 1 < len(words):
            method = words[i + 1].upper()
    for word in words:
        url = local_url(word)
        if url:
            port, path = url
            check_port(port, word, where)
            check_route(method, path or "/", where)


def local_url(word: str) -> tuple[str | None, str] | None:
    """(port, path) of a URL on this machine, the gateway's in this README."""
    match = re.fullmatch(r"(?:https?://)?(?:localhost|127\.0\.0\.1)(?::(\d+))?(/\S*)?", word)
    return (match[1], match[2] or "") if match else None


def check_port(port: str | None, url: str, where: str) -> None:
    if port != str(PORT):
        raise ReadmeError(f"{where}: {url} is not the gateway's documented port {PORT}")


def check_pip_install(words: list[str], where: str) -> None:
    for word in words[words.index("install") + 1:]:
        match = re.fullmatch(r"(?:\.|kv-gateway)\[([^\]]*)\]", word)
        unknown = {e.strip() for e in match[1].split(",")} - extras() if match else set()
        if unknown:
            raise ReadmeError(f"{where}: pyproject.toml defines no extra {sorted(unknown)}; it has {sorted(extras())}")


def hashed_keys(value: str) -> str:
    """``value`` with each ``$(gateway hash-key KEY)`` replaced by what the command prints."""
    return re.sub(r"\$\(gateway hash-key (\S+?)\)", lambda m: hash_api_key(m[1]), value)


def check_command(words: list[str], where: str) -> None:
    environ = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, _, value = words[0].partition("=")
        environ[name] = value
        words = words[1:]
    if words[:1] == ["export"]:
        environ.update(w.partition("=")[::2] for w in words[1:] if "=" in w)
        words = []
    environ = {name: hashed_keys(value) for name, value in environ.items()}
    if any(k.startswith("GATEWAY_") for k in environ):
        check_config_fragment(env_overrides(environ), f"{where} (GATEWAY_* variables)")
    if not words:
        return
    program = Path(words[0]).name
    if program == "gateway":
        check_gateway_command(words[1:], environ, where)
    elif program == "make":
        unknown = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in make_targets()]
        if unknown:
            raise ReadmeError(f"{where}: the Makefile has no target {unknown}")
    elif program == "curl":
        check_curl(words[1:], where)
    elif (program.startswith("pip") or words[1:3] == ["-m", "pip"]) and "install" in words:
        check_pip_install(words, where)
    for word in words:
        if word.startswith(REPO_DIRS) and not (ROOT / word.split("::")[0]).exists():
            raise ReadmeError(f"{where}: {word} is not in the repository")


def check_shell(block: Block) -> None:
    for words in shell_commands(block.text, console=block.lang == "console"):
        check_command(words, str(block))


def check_python(block: Block) -> None:
    try:
        compile(block.text, str(block), "exec")
    except SyntaxError as exc:
        raise ReadmeError(f"{block}: {exc}") from exc
    for url in re.findall(r"https?://(?:localhost|127\.0\.0\.1)[^\s\"']*", block.text):
        check_port(local_url(url)[0], url, str(block))


# What Codex needs of a provider (0.171.0 refuses a config without ``name``), and of the config: a ``model``
# the gateway serves, or it asks for its own default.
CODEX_PROVIDER_KEYS = {"name", "base_url", "env_key", "wire_api"}


def check_toml(block: Block) -> None:
    """A Codex ``config.toml``: it parses, names a model, and each provider has what Codex needs, its URL
    the gateway's and its key in a variable the gateway does not read as its own config (``GATEWAY_*``)."""
    try:
        data = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as exc:
        raise ReadmeError(f"{block}: not TOML: {exc}") from exc
    providers = data.get("model_providers", {})
    if providers and not data.get("model"):
        raise ReadmeError(f"{block}: no `model`: Codex would ask the gateway for its own default model")
    for name, provider in providers.items():
        missing = CODEX_PROVIDER_KEYS - set(provider)
        if missing:
            raise ReadmeError(f"{block}: model_providers.{name} lacks {sorted(missing)}, which Codex needs")
        check_port(local_url(provider["base_url"])[0] if local_url(provider["base_url"]) else None,
                   provider["base_url"], str(block))
        if provider["env_key"].startswith("GATEWAY_"):
            raise ReadmeError(f"{block}: env_key {provider['env_key']} is read by the gateway as its config")


def check_block(block: Block) -> None:
    if block.mark and block.mark.startswith("skip"):
        return
    if block.lang in ("yaml", "yml"):
        check_yaml(block)
    elif block.lang in SHELL:
        check_shell(block)
    elif block.lang == "python":
        check_python(block)
    elif block.lang == "toml":
        check_toml(block)
    elif block.mark is not None or block.lang == "":
        raise ReadmeError(f"{block}: a block needs a language the test knows ({block.mark or 'none given'})")


# --- the prose --------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match[1])
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def check_links(text: str, source: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (source.parent / file) if file else source
        if not path.exists():
            raise ReadmeError(f"{source.name}: link to {file}, which does not exist")
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            raise ReadmeError(f"{source.name}: link to {target}, but {path.name} has no heading #{anchor}")


def check_endpoints(text: str) -> None:
    for method, path in re.findall(r"`(GET|POST) (/[^`\s]*)`", prose(text)):
        check_route(method, path, "README.md")


@cache
def metric_names() -> frozenset[str]:
    names = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        names.update(re.findall(r"[\"'](gateway_[a-z_]+)[\"']", path.read_text()))
    return frozenset(names)


def check_metrics(text: str) -> None:
    for name in set(re.findall(r"\bgateway_[a-z_]+", prose(text))):
        base = re.sub(r"_(total|bucket|count|sum|created)$", "", name)
        known = metric_names()
        if not ({name, base} & known or (name.endswith("_") and any(k.startswith(name) for k in known))):
            raise ReadmeError(f"README.md: no metric {name} in gateway/")


def check_users_page(text: str) -> None:
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise ReadmeError(f"README.md has {len(lines)} lines, more than {MAX_LINES}: move detail to docs/")
    contents = re.search(r"^## Contents\n(.*?)^## ", text, flags=re.S | re.M)
    if not contents:
        raise ReadmeError("README.md has no '## Contents'")
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents[1]))
    sections = {slug(h) for h in re.findall(r"^## (.+)$", prose(text), flags=re.M)} - {"contents"}
    if sections - listed:
        raise ReadmeError(f"README.md: sections missing from its contents: {sorted(sections - listed)}")
    for pattern, what in ((r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b", "a commit hash"),
                          (r"\b[0-9a-f]{40}\b", "a commit hash"),
                          (r"\b(?:issue|PR|pull request)\s*#?\d+", "issue history")):
        found = re.search(pattern, text, flags=re.I)
        if found:
            raise ReadmeError(f"README.md names {what}: {found[0]!r}")


# --- the tests --------------------------------------------------------------------------------------------


def readme_blocks() -> list[Block]:
    return fenced_blocks(README.read_text())


def docs_blocks() -> list[Block]:
    """The blocks of docs/*.md that name a language (the others are diagrams)."""
    return [b for page in sorted((ROOT / "docs").glob("*.md"))
            for b in fenced_blocks(page.read_text(), f"docs/{page.name}") if b.lang]


@pytest.mark.parametrize("block", readme_blocks(), ids=str)
def test_block_holds(block):
    check_block(block)


@pytest.mark.parametrize("block", docs_blocks(), ids=str)
def test_docs_block_holds(block):
    """The pages in docs/ are held to the README's rules: their configs load, their commands parse."""
    check_block(block)


def test_docs_blocks_are_checked():
    """The docs' config and command blocks are found, so that the test above checks something."""
    kinds = {b.lang for b in docs_blocks() if not (b.mark or "").startswith("skip")}
    assert {"yaml", "python"} <= kinds and kinds & SHELL


def test_every_kind_of_block_is_there():
    """The README keeps a config block, a shell block and a python block, all checked."""
    kinds = {b.lang for b in readme_blocks() if not (b.mark or "").startswith("skip")}
    assert {"yaml", "python"} <= kinds and kinds & SHELL


def test_links_endpoints_and_metrics_exist():
    text = README.read_text()
    check_links(text, README)
    check_endpoints(text)
    check_metrics(text)


def test_it_stays_a_users_page():
    check_users_page(README.read_text())


# Each rule, broken once: the checks must fail on it.
BROKEN_BLOCKS = [
    ("yaml", None, "routing: {polcy: kv_aware}"),
    ("yaml", None, "routing: {policy: kv_aware, options: {kv_aware: {prefix_wieght: 1.0}}}"),
    ("yaml", None, "server: {port: eighty}"),
    ("yaml", None, "policy: kv_aware"),
    ("yaml", "helm-values", "serviceMonitr: {enabled: true}"),
    ("yaml", "helm-values", "pods: {list: [{url: ftp://vllm-0:8000}]}"),
    ("yaml", "helm-values", "config: {routing: {policy: kv_aware, retries: 2}}"),
    ("sh", None, "gateway serve --mock-podz 2"),
    ("sh", None, "gateway serve --policy kv_awre --mock-pods 2"),
    ("sh", None, "gateway serve --pod http://10.0.0.5:8000,event=tcp://10.0.0.5:5557"),
    ("sh", None, "gateway srve --mock-pods 2"),
    ("sh", None, "GATEWAY_SERVER__PROT=9000 gateway serve --mock-pods 2"),
    ("bash", None, "make runn"),
    ("sh", None, "make install && make tset"),
    ("sh", None, "curl -s localhost:8081/v1/models"),
    ("sh", None, "curl -s localhost/v1/models"),
    ("sh", None, "curl -s localhost:8080/v1/chat -d '{}'"),
    ("sh", None, "curl -s localhost:8080/v1/models -d '{\"model\": '"),
    ("sh", None, "curl -s localhost:8080/debug/pods \\\n  -X POST"),
    ("sh", None, "pip install 'kv-gateway[otle]'"),
    ("sh", None, ".tools/helm upgrade --install gw charts/gatway"),
    ("console", None, "$ gateway config chek gateway.yaml"),
    ("python", None, "print("),
    ("python", None, 'base_url = "http://localhost:8000/v1"'),
    ("text", "helm-values", "a: 1"),
    ("toml", None, 'model = "m"\n[model_providers.gw]\nbase_url = "http://localhost:8080/v1"\nenv_key = "K"\n'
                   'wire_api = "responses"'),
    ("toml", None, '[model_providers.gw]\nname = "gw"\nbase_url = "http://localhost:8080/v1"\nenv_key = "K"\n'
                   'wire_api = "responses"'),
    ("toml", None, 'model = "m"\n[model_providers.gw]\nname = "gw"\nbase_url = "http://localhost:8080/v1"\n'
                   'env_key = "GATEWAY_API_KEY"\nwire_api = "responses"'),
    ("toml", None, 'model = "m"\n[model_providers.gw]\nname = "gw"\nbase_url = "http://localhost:9/v1"\n'
                   'env_key = "K"\nwire_api = "responses"'),
    ("toml", None, 'model = "m'),
]


@pytest.mark.parametrize(("lang", "mark", "text"), BROKEN_BLOCKS)
def test_a_wrong_block_fails(lang, mark, text):
    with pytest.raises(ReadmeError):
        check_block(Block(lang, text, 1, mark))


@pytest.mark.parametrize(("lang", "mark", "text"), [
    ("yaml", None, "routing: {policy: kv_aware, options: {kv_aware: {prefix_weight: 2.0}}}"),
    ("yaml", "helm-values", "pods: {discovery: kubernetes, labelSelector: app=vllm}\nconfig: {logging: {json: true}}"),
    ("sh", None, "GATEWAY_SERVER__PORT=9000 gateway serve --mock-pods 2 --policy kv_aware  # a comment"),
    ("console", None, "$ curl -s localhost:8080/v1/models\n{\"object\": \"list\"}"),
    ("sh", None, "pip install 'kv-gateway[otel,nvidia]'"),
    ("sh", None, 'export GATEWAY_AUTH__API_KEY_HASHES="[\\"$(gateway hash-key sk-1)\\"]"\ngateway serve --mock-pods 2'),
    ("yaml", "skip (a fragment of something else)", "not: [valid"),
    ("toml", None, 'model = "m"\n[model_providers.gw]\nname = "gw"\nbase_url = "http://localhost:8080/v1"\n'
                   'env_key = "K"\nwire_api = "responses"'),
])
def test_a_right_block_passes(lang, mark, text):
    check_block(Block(lang, text, 1, mark))


def test_wrong_prose_fails(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# T\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("# A\n\n## Keep-warm\n")
    for text in ("[x](docs/b.md)", "[x](docs/a.md#keep-cold)", "[x](#nowhere)"):
        with pytest.raises(ReadmeError):
            check_links(text, page)
    check_links("[x](docs/a.md#keep-warm) [y](https://example.com)", page)
    for text in ("`GET /debug/nothing`", "`POST /healthz`"):
        with pytest.raises(ReadmeError):
            check_endpoints(text)
    with pytest.raises(ReadmeError):
        check_metrics("`gateway_requests_totl`")
    good = "# t\n\n## Contents\n\n- [Use](#use)\n\n## Use\n\nrun it\n"
    check_users_page(good)
    for text in (good + "measured at 15597f3\n", good + "as issue 32 found\n", good + "## Other\n",
                 "# t\n\n## Use\n", good + "x\n" * MAX_LINES):
        with pytest.raises(ReadmeError):
            check_users_page(text)


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_links_resolve(page):
    """What moved from the README to docs/ links back and across correctly."""
    check_links(page.read_text(), page)
