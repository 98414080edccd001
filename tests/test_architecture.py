"""The package's structure, read from its source (no imports run): kpipe's modules import
each other without a circle (function-level imports included), the loader's readers reach
its parts only through the stream protocol, backends are told apart by what they declare,
and no module outgrows the house size."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "kpipe")
MAX_LINES = 700
LOADER_MAX_LINES = 500


def _modules():
    """{module name: path} for every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _trees():
    return {name: ast.parse(open(path, encoding="utf-8").read(), path) for name, path in MODULES.items()}


TREES = _trees()


def _imports(name, tree):
    """The kpipe modules `name` imports, anywhere in it (function-level imports too)."""
    package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_even_through_function_level_imports():
    graph = {name: _imports(name, tree) for name, tree in TREES.items()}
    # a package's __init__ re-exports its submodules: the edge from a submodule up to its
    # own package (Python runs the package first) is not a dependency of the submodule
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert _cycles(graph) == []


# The loader's parts, and the names by which modules hold them: only the module that
# defines a part touches its private names.
_PART_HOLDERS = {"loader", "source", "reader", "backend", "window", "position", "ahead", "consumer", "stream"}


def test_no_module_reads_or_sets_a_private_name_of_the_loaders_parts():
    offending = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in _PART_HOLDERS):
                offending.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert offending == []


def test_backends_are_told_apart_by_their_capabilities_not_their_class():
    backends = {"ProcessBackend", "ThreadBackend", "InlineBackend", "Backend"}
    offending = []
    for name, tree in TREES.items():
        if name.startswith("kpipe._engine"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                classes = ast.walk(node.args[1]) if len(node.args) > 1 else []
                if any(getattr(c, "id", getattr(c, "attr", None)) in backends for c in classes):
                    offending.append(f"{name}:{node.lineno}")
    assert offending == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_within_the_house_size(name):
    with open(MODULES[name], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    if name == "kpipe.loader":
        assert lines < LOADER_MAX_LINES, f"{name}: {lines} lines"  # (the facade: under 500)
    else:
        assert lines <= MAX_LINES, f"{name}: {lines} lines"
