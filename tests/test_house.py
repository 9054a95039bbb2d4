"""How the code is kept: every piece of hidden state in funcgrad is documented
(docs/internals.md), the library's modules import in one direction, and test modules
import shared code from tests/references.py, never from one another."""

from __future__ import annotations

import ast
import contextvars
import importlib
import pkgutil
import threading
import weakref
from pathlib import Path

import funcgrad

ROOT = Path(__file__).resolve().parents[1]
MUTABLE = (
    threading.local,
    contextvars.ContextVar,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
    dict,
    list,
    set,
    type(threading.Lock()),
    type(threading.RLock()),
)


# funcgrad's layers, lowest first: a module may import its own layer and those below,
# never one above (docs/internals.md, "Where things live"). Top-level modules other than
# these (funcgrad/hooks.py, funcgrad/__init__.py) are the façade, above everything.
LAYERS = (
    "_compat",
    "core",
    "model",
    "rules",
    "transforms",
    "optim",
    "distributed",
    "io",
    "step",
    "torch_optim",
)
FACADE = ("hooks", "__init__")


def _modules() -> list[str]:
    """Every module of funcgrad, dotted (``funcgrad.core._flat``), packages included."""
    found = ["funcgrad"]
    found += [m.name for m in pkgutil.walk_packages(funcgrad.__path__, "funcgrad.")]
    return sorted(found)


def _path(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    pkg = ROOT / "funcgrad" / rel / "__init__.py"
    return pkg if pkg.exists() else ROOT / "funcgrad" / rel.with_suffix(".py")


def test_every_module_level_state_is_documented():
    doc = (ROOT / "docs" / "internals.md").read_text()
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.startswith("__") or not isinstance(value, MUTABLE):
                continue
            found.append(f"{name}.{attr}")
    missing = [f for f in found if f"`{f}`" not in doc]
    assert found, "the scan found nothing: it no longer sees funcgrad's modules"
    assert not missing, (
        f"module-level state not in docs/internals.md: {missing}. Pass it through the "
        "arguments instead, or add a row saying what it holds, who sets it and why."
    )
    modules = set(_modules())
    listed = {w.strip("`") for w in doc.split() if w.startswith("`funcgrad.")}
    # module-level names (a module, then one name); class attributes: the next test
    gone = sorted(w for w in listed if w.rsplit(".", 1)[0] in modules and w not in found)
    assert not gone, f"docs/internals.md lists state that no longer exists: {gone}"


def _rebinds_globals(tree: ast.AST) -> int:
    """How many ``global`` statements and ``globals()`` calls ``tree`` holds."""
    found = 0
    for node in ast.walk(tree):
        is_global = isinstance(node, ast.Global)
        is_globals = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "globals"
        )
        found += is_global or is_globals
    return found


def test_no_module_rebinds_its_own_globals_at_run_time():
    """A ``global`` statement or a ``globals()`` write is module state set at run time,
    which the scan above sees only once it is set: none in funcgrad (``fg.sharded``'s
    state classes are found by name through a documented weak table and the module's
    ``__getattr__``)."""
    found = {}
    for name in _modules():
        n = _rebinds_globals(ast.parse(_path(name).read_text()))
        if n:
            found[name] = n
    assert not found, (
        f"run-time writes of module globals: {found}. Pass the state through the "
        "arguments, or keep it in an object made at import and documented in "
        "docs/internals.md."
    )
    # the scan sees both forms
    snippet = "def f():\n    global X\n    globals()['Y'] = 1\n"
    assert _rebinds_globals(ast.parse(snippet)) == 2


def test_every_mutable_class_attribute_is_documented():
    """Class-level mutable attributes (a cache shared by every instance, e.g.
    ``Layout._interned``) are hidden state too; NamedTuple's own ``_field_defaults``
    is not."""
    import inspect

    doc = (ROOT / "docs" / "internals.md").read_text()
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for cname, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for attr, value in vars(cls).items():
                if attr.startswith("__") or attr == "_field_defaults":
                    continue
                if isinstance(value, MUTABLE):
                    found.append(f"{name}.{cname}.{attr}")
    assert "funcgrad.core._layout.Layout._interned" in found, (
        "the scan no longer sees class attributes"
    )
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


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import nodes under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out.update(n for n in ast.walk(node) if isinstance(n, ast.ImportFrom | ast.Import))
    return out


def _funcgrad_imports(module: str, top_level_only: bool) -> set[str]:
    """The funcgrad modules ``module`` imports (``from ..core._base import x`` ->
    ``funcgrad.core._base``; ``from . import _rule_base`` -> that module), module-level
    statements only or every import (in functions too), never ``TYPE_CHECKING`` ones."""
    path = _path(module)
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    skip = _type_checking_only(tree)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    modules = set(_modules())
    out = set()
    for node in nodes:
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "funcgrad")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
                if base.split(".")[0] != "funcgrad":
                    continue
            else:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" for a in node.names]
            sub = [n for n in names if n in modules]
            out.update(sub if sub else [base])
    return {m for m in out if m in modules and m != module}


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
    a function, which defers one on purpose, is not counted). A package's
    ``__init__`` counts as importing nothing of its own modules it does not name."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph = {m: _funcgrad_imports(m, top_level_only=True) for m in _modules()}
    assert len(graph) > 40 and any(graph.values())
    assert "funcgrad.core._base" in graph["funcgrad.optim._adam"], "the scan misreads imports"
    found = _cycle(graph)
    assert found is None, f"import cycle in funcgrad: {' -> '.join(found)}"


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    if part in FACADE:
        return len(LAYERS)
    assert part in LAYERS, (
        f"{module} is in no layer of tests/test_house.py's LAYERS: put it in a subpackage "
        "(docs/internals.md, 'Where things live') or add its layer there."
    )
    return LAYERS.index(part)


def test_rules_import_only_core():
    """Rules are functions of gradients: ``funcgrad.rules`` imports ``core`` (and
    ``_compat``), not the model layer, though the layer order would allow it."""
    found = [
        f"{module} imports {dep}"
        for module in _modules()
        if module.startswith("funcgrad.rules")
        for dep in sorted(_funcgrad_imports(module, top_level_only=False))
        if _layer(dep) not in (_layer("funcgrad.core"), _layer("funcgrad._compat"))
        and not dep.startswith("funcgrad.rules")
    ]
    assert not found, f"{found}: rules take what they need from funcgrad.core"


def test_no_module_imports_a_layer_above_its_own():
    """Imports point one way: core <- model <- rules <- transforms <- optim <-
    distributed <- io <- step <- torch_optim <- the façade (``funcgrad/__init__.py``,
    ``hooks``). Every
    import counts, also one deferred into a function; ``if TYPE_CHECKING:`` ones
    (annotations) do not."""
    assert _layer("funcgrad.optim._adam") > _layer("funcgrad.core._base")
    upward = []
    for module in _modules():
        for dep in sorted(_funcgrad_imports(module, top_level_only=False)):
            if _layer(dep) > _layer(module):
                upward.append(f"{module} imports {dep}")
    assert not upward, (
        f"{upward}: a module may import its own layer and those below it "
        f"({' < '.join(LAYERS)} < façade). Move the shared piece down, or pass it in."
    )


PRIVATE_TORCH = (
    "torch._C",
    "torch.utils._pytree",
    "_functional_collectives",
    "torch._dynamo",
    "torch._inductor",
    "_get_scale_async",
    "optree._",
    "torch._functorch",
    "torch._subclasses",
    "torch._guards",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
)
# private attributes reached through getattr(obj, "name"): a string in the code
PRIVATE_ATTRS = (
    "_get_scale_async",
    "_functorch",
    "peek_interpreter_stack",
    "is_functorch_wrapped_tensor",
    "__GLOBAL_NAMESPACE",
)


def test_private_torch_api_is_used_in_funcgrad_compat_only():
    """torch's (and optree's) private names appear in code only in funcgrad/_compat.py
    (docstrings and comments may name them; ``torch._foreach_*`` may stay where used)."""
    import io
    import tokenize

    offenders = []
    for module in _modules():
        path = _path(module)
        if path.name == "_compat.py":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        code, strings = [], set()
        for tok in tokens:
            if tok.type == tokenize.STRING:
                strings.add(tok.string.strip("'\""))
            elif tok.type != tokenize.COMMENT:
                code.append(tok.string)
        text = "".join(code)
        for name in PRIVATE_TORCH:
            if name in text:
                offenders.append(f"{path.relative_to(ROOT)} uses {name}")
        offenders += [f"{path.relative_to(ROOT)} uses {a}" for a in PRIVATE_ATTRS if a in strings]
        if "torch._" in text.replace("torch._foreach_", ""):
            offenders.append(f"{path.relative_to(ROOT)} uses torch._*")
    assert not offenders, (
        f"{offenders}: torch's private API lives in funcgrad/_compat.py, each use with the "
        "version it was checked on and its replacement (tests/test_compat.py runs each)."
    )


def test_library_code_never_points_at_benchmarks():
    """benchmarks/ is not shipped: funcgrad's code, docstrings and messages point at
    docs/ instead (a user who installed the wheel has no benchmarks/ to open)."""
    found = [
        f"{_path(m).relative_to(ROOT)}:{i}"
        for m in _modules()
        for i, line in enumerate(_path(m).read_text().splitlines(), 1)
        if "benchmarks/" in line
    ]
    assert not found, f"{found}: point at docs/ (benchmarks/ is not in the package)"


def _suite_offenders(folder: Path) -> list[str]:
    """What makes a folder of benchmark scripts a lab notebook rather than a suite."""
    offenders = []
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith(("study_", "repro_", "stress_")):
            offenders.append(f"{path.name}: studies and repros retire to docs/, stress to tools/")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name} imports {n}" for n in names if n.startswith("bench_")]
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path."):
                offenders.append(f"{path.name} edits sys.path")
    return offenders


def test_benchmarks_are_a_suite_over_one_shared_module():
    """Every benchmark imports what it shares from benchmarks/common.py only (not from
    another benchmark), edits no ``sys.path`` (a script's own folder is on it), and no
    one-off study, torch repro or stress run sits among them."""
    offenders = _suite_offenders(ROOT / "benchmarks")
    assert not offenders, offenders


def test_the_suite_check_sees_a_lab_notebook(tmp_path: Path):
    """The check above fails on what benchmarks/ held before #53's second pass."""
    (tmp_path / "bench_a.py").write_text("import sys\nsys.path.insert(0, 'x')\n")
    (tmp_path / "bench_b.py").write_text("from bench_a import interleaved\n")
    (tmp_path / "study_c.py").write_text("")
    assert _suite_offenders(tmp_path) == [
        "bench_a.py edits sys.path",
        "bench_b.py imports bench_a",
        "study_c.py: studies and repros retire to docs/, stress to tools/",
    ]


def test_import_funcgrad_loads_no_distributed_checkpoint():
    """``import funcgrad`` loads ``torch.distributed.checkpoint`` and the functional
    collectives only when used (a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, funcgrad; "
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'torch.distributed.checkpoint', 'torch.distributed._functional_collectives', "
        "'torch.distributed.tensor'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


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


def test_every_public_function_is_in_the_api_reference():
    """Each public function and class of funcgrad (not the state NamedTuples, which
    the optimizer pages describe) is rendered in docs/api/ (mkdocstrings)."""
    import inspect

    text = "".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    public = [n for n in dir(funcgrad) if not n.startswith("_")]
    missing = [
        n
        for n in public
        if not inspect.ismodule(getattr(funcgrad, n))
        and not n.endswith("State")
        and n != "Params"
        and f"::: funcgrad.{n}\n" not in text
    ]
    assert not missing, f"not in docs/api/*.md: {missing}"


def test_the_readme_stays_under_150_lines():
    """The README is the front page: what funcgrad is, the two commands, the box, links.
    Figures and guides live in docs/ and benchmarks/README.md."""
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_no_module_is_over_450_lines():
    """A module one can hold: each of funcgrad's files under 450 lines (split along a
    seam, and say in the new module's docstring what lives there)."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "funcgrad").rglob("*.py")
    }
    assert len(sizes) > 60
    over = {p: n for p, n in sizes.items() if n > 450}
    assert not over, f"modules over 450 lines: {over}"
