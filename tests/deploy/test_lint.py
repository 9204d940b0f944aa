"""The package passes ruff (pyproject.toml's [tool.ruff]: pyflakes, syntax errors, and the complexity cap C901)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # installed with the test extra, in the running venv
    return [str(beside)] if beside.exists() else [shutil.which("ruff") or "ruff"]


def test_the_package_passes_ruff_with_the_complexity_check():
    run = subprocess.run([*_ruff(), "check", "--no-cache", "oai_gemma"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


PACKAGE = ROOT / "oai_gemma"
MAX_LINES = 400


def test_no_file_in_the_request_path_or_engine_is_over_400_lines():
    # issue 17: api/, chat/ and engine/ stay readable in one sitting
    long = {str(p.relative_to(ROOT)): n for d in ("api", "chat", "engine") for p in (PACKAGE / d).glob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package modules `path` imports, at module level or inside a function (`if TYPE_CHECKING:` blocks left
    out: they never run), with the packages whose `__init__` such an import runs (its own packages aside)."""
    import ast

    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    nodes = list(ast.parse(path.read_text()).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("oai_gemma")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [node.module])])
            if base.startswith("oai_gemma"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        else:
            nodes.extend(ast.iter_child_nodes(node))
    own = {".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 2)}
    parents = {".".join(name.split(".")[:n]) for name in found for n in range(1, name.count(".") + 1)}
    return found | (parents - own)


def test_the_package_imports_have_no_circle():
    # issues 17 and 25: no import circle, counting imports inside functions and package `__init__` modules
    # (imports only for type checking do not count: they never run)
    graph = {_module_of(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in imports if i in graph and i != m} for m, imports in graph.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def _engine_rooms_imported(room: str) -> dict[str, set[str]]:
    """Per module of engine/`room`: the engine's other parts it imports (`oai_gemma.engine.X...` for X not `room`)."""
    found = {}
    for path in (PACKAGE / "engine" / room).rglob("*.py"):
        other = {name for name in _imports(path) if name.startswith("oai_gemma.engine.")
                 and name.split(".")[2] != room}
        if other:
            found[_module_of(path)] = other
    return found


def test_the_kernels_floor_imports_no_other_engine_room():
    # issue 38: engine/ops (the linears, invariance, the native kernels) is the bottom floor; model/, lora/, cache/,
    # config build on it, never the other way round (top-level utilities such as oai_gemma.cpu are fine)
    assert (PACKAGE / "engine" / "ops" / "__init__.py").exists()
    assert not _engine_rooms_imported("ops")


def test_the_cache_imports_nothing_of_the_model():
    # issue 38: cache/ learns the layers' kinds and the window from engine/shape.py, not from model/
    cache = {module: {name for name in names if name.startswith("oai_gemma.engine.model")}
             for module, names in _engine_rooms_imported("cache").items()}
    assert not {module: names for module, names in cache.items() if names}
