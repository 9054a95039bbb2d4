"""How the code is kept: every piece of hidden state in funcgrad is documented
(docs/internals.md), the library's modules import in one direction, and test modules
import shared code from tests/references.py, never from one another."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import threading
import weakref
from pathlib import Path

import funcgrad

ROOT = Path(__file__).resolve().parents[1]
MUTABLE = (
    threading.local,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
    dict,
    list,
    set,
)


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(funcgrad.__path__))


def test_every_module_level_state_is_documented():
    doc = (ROOT / "docs" / "internals.md").read_text()
    found = []
    for name in _modules():
        module = importlib.import_module(f"funcgrad.{name}")
        for attr, value in vars(module).items():
            if attr.startswith("__") or not isinstance(value, MUTABLE):
                continue
            found.append(f"funcgrad.{name}.{attr}")
    missing = [f for f in found if f"`{f}`" not in doc]
    assert found, "the scan found nothing: it no longer sees funcgrad's modules"
    assert not missing, (
        f"module-level state not in docs/internals.md: {missing}. Pass it through the "
        "arguments instead, or add a row saying what it holds, who sets it and why."
    )
    listed = {w.strip("`") for w in doc.split() if w.startswith("`funcgrad.")}
    # module-level names (funcgrad.<module>.<name>); class attributes: the next test
    gone = sorted(w for w in listed if w.count(".") == 2 and w not in found)
    assert not gone, f"docs/internals.md lists state that no longer exists: {gone}"


def test_every_mutable_class_attribute_is_documented():
    """Class-level mutable attributes (a cache shared by every instance, e.g.
    ``Layout._interned``) are hidden state too; NamedTuple's own ``_field_defaults``
    is not."""
    import inspect

    doc = (ROOT / "docs" / "internals.md").read_text()
    found = []
    for name in _modules():
        module = importlib.import_module(f"funcgrad.{name}")
        for cname, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for attr, value in vars(cls).items():
                if attr.startswith("__") or attr == "_field_defaults":
                    continue
                if isinstance(value, MUTABLE):
                    found.append(f"funcgrad.{name}.{cname}.{attr}")
    assert "funcgrad._flat.Layout._interned" in found, "the scan no longer sees class attributes"
    missing = [f for f in found if f"`{f}`" not in doc]
    assert not missing, (
        f"mutable class attributes not in docs/internals.md: {missing}. Make them instance "
        "state or arguments, or add a row saying what they hold and why."
    )


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in ``path`` (level 0: absolute)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
            if node.module is None:  # from . import _x
                out += [(node.level, a.name) for a in node.names]
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep, [*path, dep])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_funcgrad_has_no_import_cycle():
    """Module-level imports between funcgrad's modules form no cycle (an import inside
    a function, which defers one on purpose, is not counted)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    names = set(_modules())
    graph: dict[str, set[str]] = {}
    for name in names:
        deps = set()
        for node in ast.parse((ROOT / "funcgrad" / f"{name}.py").read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.update(
                    [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                )
        graph[name] = deps & names
    assert len(graph) > 30 and any(graph.values())
    found = _cycle(graph)
    assert found is None, f"import cycle in funcgrad: {' -> '.join(found)}"


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for level, module in _imports(path):
            top = module.split(".")[0]
            if level == 0 and (top.startswith("test_") or top == "conftest"):
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, (
        f"{offenders}: shared models, data and references belong in tests/references.py "
        "(tests/integrations/integration_refs.py for the framework tests)."
    )
