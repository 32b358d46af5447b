"""The layers of the code, bottom to top: every import (type-only and deferred ones included) goes to the
same layer or one below, and no module imports itself back through others. An import that must go up
says why on its line (``# layering: <reason>``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "plugins", "simulator", "bench")

# Bottom to top; a module belongs to the first layer with a prefix of its name. ``docs/architecture.md``
# draws the same picture.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core: request and answer types, domain errors, context names, shared facts", ("gateway.core",)),
    ("foundation: settings, the event loop, caches, the HTTP client, metrics, plugin and extension lookup",
     ("gateway.config", "gateway.config_reload", "gateway.background", "gateway.lru", "gateway.logs",
      "gateway.http_client", "gateway.metrics", "gateway.loop_histogram", "gateway.plugin_registry",
      "gateway.extensions")),
    ("state: pods, load, what each pod caches, tokens, the Responses API's stored responses",
     ("gateway.pods", "gateway.load", "gateway.kv", "gateway.tokenization", "gateway.responses")),
    ("decisions: who may ask, admission and flow control, routing, workflows, pressure, and the plugins that "
     "decide", ("gateway.auth", "gateway.admission", "gateway.flow", "gateway.routing", "gateway.workflow",
                "gateway.pressure", "gateway.models", "gateway.limits", "gateway.plugin_api", "plugins")),
    ("sharing: workers and replicas telling each other their changes", ("gateway.cluster",)),
    ("HTTP errors: the domain's errors in each API's shape and status", ("gateway.http_errors",)),
    ("request path: forwarding, the pipeline", ("gateway.proxy", "gateway.request")),
    ("assembly: the fleet's membership, the routes, the feature kits, the wiring, the endpoint picker's edge",
     ("gateway.pod_membership", "gateway.api", "gateway.kits", "gateway.app", "gateway.epp")),
    ("processes: the server, its supervisor, the host's indexer, the endpoint picker, the command line",
     ("gateway.serve", "gateway.supervisor", "gateway.indexer", "gateway.epp.grpc_server", "gateway.cli",
      "gateway.__main__")),
    ("the simulator: simulated vLLM and SGLang pods (package simulator, extra [simulator])", ("simulator",)),
    ("the benchmark: the harness and the scripts (package bench, extra [bench])", ("bench",)),
]


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _layer(module: str) -> int:
    if module in PACKAGES:  # the packages themselves: empty
        return 0
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(imported module, line, source line) for every import of a module of ours."""
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.append((name, node.lineno, lines[node.lineno - 1]))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {target for target, _, _ in _imports(p, modules) if target != m} for m, p in modules.items()}


def test_every_import_goes_down_or_says_why():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        for target, line, text in _imports(path, modules):
            if _layer(target) > _layer(module) and "# layering:" not in text:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[_layer(module)][0].split(':')[0]})"
                              f" imports {target} ({LAYERS[_layer(target)][0].split(':')[0]})")
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_the_checks_see_what_they_should():
    """The scanner finds deferred and type-only imports, and the layers cover every module."""
    modules = _modules()
    app = {target for target, _, _ in _imports(modules["gateway.kits.serving"], modules)}
    assert "gateway.request.tracing" in app  # imported inside TracingKit, only with tracing on
    routing = {target for target, _, _ in _imports(modules["gateway.routing.policy"], modules)}
    assert "gateway.kv.working_set" in routing  # under TYPE_CHECKING
    assert all(_layer(m) >= 0 for m in modules)


# The one module of the runtime a plugin may import: the extension points, the views they receive, and what
# plugins are built from. Anything else a plugin took from ``gateway`` would tie it to an internal.
PLUGIN_CONTRACT = "gateway.plugin_api"


def test_plugins_import_nothing_of_the_runtime_but_the_contract():
    modules = _modules()
    reaching = sorted({f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
                for module, path in sorted(modules.items()) if module.split(".")[0] == "plugins"
                for target, line, text in _imports(path, modules)
                if target.split(".")[0] == "gateway" and target != PLUGIN_CONTRACT})
    assert not reaching, f"plugins import the runtime beyond {PLUGIN_CONTRACT}:\n" + "\n".join(reaching)


# A module past this many lines holds more than one idea; the runtime (``gateway/``) keeps each file under it.
MAX_MODULE_LINES = 450


def test_no_runtime_module_is_past_the_line_limit():
    too_long = {str(path.relative_to(ROOT)): n for name, path in _modules().items()
                if name.split(".")[0] == "gateway" and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, f"split these modules (over {MAX_MODULE_LINES} lines): {too_long}"


# The assembly only composes kits: past this, a feature is being built there instead of in its kit.
MAX_ASSEMBLY_LINES = 150


def test_the_assembly_stays_a_composition():
    lines = len((ROOT / "gateway/app.py").read_text().splitlines())
    assert lines <= MAX_ASSEMBLY_LINES, f"gateway/app.py has {lines} lines (at most {MAX_ASSEMBLY_LINES})"


def _package(module: str) -> str:
    """The package a module is part of (``gateway.pressure.monitor``: ``gateway.pressure``); a module at a
    package's top (``gateway.app``) is its own."""
    return ".".join(module.split(".")[:2])


def test_no_two_packages_import_each_other():
    """Modules may import within one layer, but two packages that import each other are one feature in two
    homes (pressure and workflow were: the modes moved below both, to ``gateway/load/pressure_modes.py``)."""
    ties: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        for target in targets:
            if _package(target) != _package(module):
                ties.setdefault(_package(module), set()).add(_package(target))
    both_ways = sorted({tuple(sorted((a, b))) for a, bs in ties.items() for b in bs if a in ties.get(b, ())})
    assert not both_ways, f"packages that import each other: {both_ways}"


# A function past this many lines does more than one thing; the runtime (``gateway/``) keeps each under it.
MAX_FUNCTION_LINES = 60
# Functions allowed past the limit, as ``path::qualified name``: none since the feature kits ended the last,
# ``build_gateway``; nothing is to be added here.
LONG_FUNCTIONS_ALLOWED: frozenset[str] = frozenset()


def _long_functions(tree: ast.AST, path: str, prefix: str = "") -> dict[str, int]:
    """``path::Class.function`` → lines, for every function (methods and nested ones too) past the limit."""
    found = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                found[f"{path}::{name}"] = n
            found.update(_long_functions(node, path, name + "."))
        else:
            found.update(_long_functions(node, path, prefix))
    return found


def test_no_runtime_function_is_past_the_line_limit():
    too_long = {}
    for name, path in _modules().items():
        if name.split(".")[0] == "gateway":
            too_long.update(_long_functions(ast.parse(path.read_text()), str(path.relative_to(ROOT))))
    unlisted = {where: n for where, n in too_long.items() if where not in LONG_FUNCTIONS_ALLOWED}
    assert not unlisted, f"split these functions (over {MAX_FUNCTION_LINES} lines): {unlisted}"
    assert _long_functions(ast.parse("def f():\n" + "    pass\n" * 60), "f.py") == {"f.py::f": 61}
