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
    # issue 38: engine/ops (the linears, invariance, the native kernels) is the kernels floor; model/, lora/ and the
    # factory build on it, never the other way round (top-level utilities such as oai_gemma.cpu are fine)
    assert (PACKAGE / "engine" / "ops" / "__init__.py").exists()
    assert not _engine_rooms_imported("ops")


def test_the_cache_imports_nothing_of_the_model():
    # issue 38: cache/ learns the layers' kinds and the window from engine/shape.py, not from model/
    cache = {module: {name for name in names if name.startswith("oai_gemma.engine.model")}
             for module, names in _engine_rooms_imported("cache").items()}
    assert not {module: names for module, names in cache.items() if names}


# ---- issue 38: the engine's rooms, floor by floor -------------------------------------------------------------

FLOORS = [
    {"types", "shape", "config"},  # plain data: what crosses the boundary, the model's shape, the configuration
    {"ops", "sequence", "observer"},  # the kernels; a sequence as it runs; the metrics hook
    {"cache", "lora", "submission"},  # the KV blocks; the adapters; one admission's event stream
    {"model", "speculative"},  # the forward pass (it adds the adapters' updates); the drafts and their verifier
    {"sampling", "encoding", "prefilling"},  # logits -> tokens -> events (Predicted Outputs' counts from speculative/); image encodes and an image's prefill in slices
    {"scheduler"},  # which sequences run next, over the cache's blocks and the adapters' slots
    {"core", "warmup"},  # the engine thread's step loop; every step shape once before ready
    {"engine"},  # the facade
    {"factory"},  # load, probe the machine, resolve the configuration, build
]
"""The engine's rooms (a sub-package of oai_gemma/engine, or one of its top-level modules) from the ground up: a room
imports only rooms on floors below its own, never one beside it or above (docs/engine.md, "Shape", draws these)."""


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["oai_gemma", "engine"] else None


def engine_rooms() -> dict[str, set[str]]:
    """Each room of the engine -> the other rooms it imports (at run time: `if TYPE_CHECKING:` imports left out)."""
    graph: dict[str, set[str]] = {}
    for path in (PACKAGE / "engine").rglob("*.py"):
        room = _room_of(_module_of(path))
        if room is not None:
            graph.setdefault(room, set()).update(
                other for name in _imports(path) if (other := _room_of(name)) not in (None, room)
            )
    return graph


def test_every_engine_room_has_its_floor():
    assert set(engine_rooms()) == set().union(*FLOORS), "a room without a floor, or a floor naming no room"


def test_no_import_inside_the_engine_runs_back_up_or_sideways():
    floor = {room: n for n, rooms in enumerate(FLOORS) for room in rooms}
    wrong = sorted(f"{room} (floor {floor[room]}) -> {other} (floor {floor[other]})"
                   for room, others in engine_rooms().items() for other in others if floor[other] >= floor[room])
    assert not wrong, wrong


def test_the_engine_rooms_import_each_other_in_no_loop():
    graph, done = engine_rooms(), set()

    def visit(room: str, path: list[str]) -> None:
        if room in path:
            raise AssertionError("rooms in a loop: " + " -> ".join([*path[path.index(room):], room]))
        if room not in done:
            for other in sorted(graph.get(room, ())):
                visit(other, [*path, room])
            done.add(room)

    for room in sorted(graph):
        visit(room, [])


def test_the_lora_room_stands_on_the_kernels_and_the_configuration_alone():
    # issue 38: lora/ above ops/, beside model/: the runner (model/) adds the adapters' updates, never the other way
    assert engine_rooms()["lora"] <= {"ops", "config"}


def test_the_configuration_imports_no_room_of_the_engine():
    # issue 38: config.py is pure: engine/factory.py probes the machine (compiles, measures) and hands `resolve` the facts
    assert not engine_rooms()["config"]


def test_the_rooms_drawn_in_docs_engine_md_are_the_codes():
    # docs/engine.md draws each room's arrows, floor by floor, between two markers; `python tests/deploy/test_lint.py` prints it
    text = (ROOT / "docs" / "engine.md").read_text()
    drawn = text.split("<!-- rooms: begin -->", 1)[1].split("<!-- rooms: end -->", 1)[0]
    assert drawn.strip("\n`") == rooms_drawing().strip("\n"), "docs/engine.md's rooms differ from the code: " + rooms_drawing()


def rooms_drawing() -> str:
    """The rooms floor by floor, top down, each with the rooms it imports (highest floor first)."""
    graph = engine_rooms()
    floor = {room: n for n, rooms in enumerate(FLOORS) for room in rooms}
    lines = []
    for n in range(len(FLOORS) - 1, -1, -1):
        for i, room in enumerate(sorted(FLOORS[n])):
            others = sorted(graph.get(room, ()), key=lambda other: (-floor[other], other))
            lines.append(f"{f'floor {n}' if i == 0 else '':8} {room:12} -> {', '.join(others) or '(no other room)'}")
    return "\n".join(lines)


def test_the_engine_meets_transformers_only_where_it_loads():
    # issue 38.4: the runner, the static decode and the kernels compute with the project's Gemma3Shape / Gemma3Weights;
    # transformers' modules and config objects are read by the loaders alone (and the lean configs are the project's
    # frozen dataclasses, engine/model/lean_config.py: nothing branches on a SimpleNamespace)
    loaders = {"oai_gemma.engine.model.loader", "oai_gemma.engine.model.tokenizer", "oai_gemma.engine.model.gguf_tokenizer"}
    importing = {_module_of(p) for p in (PACKAGE / "engine").rglob("*.py") if "from transformers" in p.read_text()
                 or "import transformers" in p.read_text()}
    assert importing <= loaders, importing - loaders
    assert not [str(p) for p in PACKAGE.rglob("*.py") if "SimpleNamespace" in p.read_text()]
    static = (PACKAGE / "engine" / "model" / "static_decode.py").read_text()
    assert "runner.model" not in static and "text_parts" not in static and ".self_attn" not in static


NAMED_ELSEWHERE = {"docs/gguf.md"}
"""Paths of other repositories a comment names (ggml's GGUF spec)."""


def test_every_file_a_comment_or_doc_names_exists():
    # issue 38.5: comments and docs name today's paths (22 named files from before the split once); a path is
    # taken relative to the repository, oai_gemma/, oai_gemma/engine/ or tests/
    import re

    named = re.compile(r"(?<![\w./-])((?:oai_gemma|engine|api|chat|docs|tests|benchmarks|bench|configs|deploy)/[\w./-]*\.(?:py|md|c|h|toml))\b")
    bases = (ROOT, PACKAGE, PACKAGE / "engine", ROOT / "tests")
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "tests").rglob("*.py")]
    missing = sorted(f"{path.relative_to(ROOT)}:{n} {ref}" for path in files
                     for n, line in enumerate(path.read_text().splitlines(), 1) for ref in named.findall(line)
                     if ref not in NAMED_ELSEWHERE and not any((base / ref).exists() for base in bases))
    assert not missing, missing


MAX_FUNCTION_LINES = 50


def test_no_file_of_the_engine_is_over_400_lines_its_rooms_included():
    long = {str(p.relative_to(ROOT)): n for p in (PACKAGE / "engine").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_function_of_the_engine_is_over_50_lines():
    # issue 38: a function of the engine is read in one screen (its docstring counted)
    import ast

    long = {f"{p.relative_to(ROOT)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
            for p in (PACKAGE / "engine").rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, long


if __name__ == "__main__":  # the rooms as docs/engine.md draws them
    print(rooms_drawing())
