"""The import graph of pdtool: no circle among module-level imports, and no import back up:
the lower rooms (the schedule package, the files, the model) never import the rooms built on
them, a worker never imports the launcher's code, and nothing imports the CLI. Read from the
sources with `ast`, imports inside functions included where a rule says so."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in SRC.rglob("*.py")}


def _imports(module_level_only: bool) -> dict[str, set[str]]:
    """module -> the pdtool modules it imports (a name imported from a package counts as its
    module when it is one)."""
    graph = defaultdict(set)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        nodes = tree.body if module_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in MODULES and t != module)
    return graph


def _under(module: str, *rooms: str) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module level", "inside functions too"])
def test_imports_have_no_circle(module_level_only):
    """Issue 36: launch -> live -> session -> launch through imports inside functions, because two
    plain values (TrainResult, Nodes) lived in the modules that used them (now in runtime.run)."""
    graph = _imports(module_level_only=module_level_only)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert circles == []


RULES = [  # (room, rooms it must never import, even inside a function)
    ("pdtool.schedule", ("pdtool.artifacts", "pdtool.planner", "pdtool.sim", "pdtool.runtime", "pdtool.model",
                         "pdtool.profiler", "pdtool.views", "pdtool.cli")),
    ("pdtool.artifacts", ("pdtool.planner", "pdtool.sim", "pdtool.runtime", "pdtool.model", "pdtool.profiler",
                          "pdtool.views", "pdtool.cli")),
    ("pdtool.model", ("pdtool.planner", "pdtool.sim", "pdtool.runtime", "pdtool.profiler", "pdtool.views",
                      "pdtool.cli")),
    ("pdtool.planner", ("pdtool.runtime", "pdtool.model", "pdtool.profiler", "pdtool.views", "pdtool.cli")),
    ("pdtool.runtime.worker", ("pdtool.runtime.launcher", "pdtool.planner", "pdtool.profiler", "pdtool.views",
                               "pdtool.cli")),
    ("pdtool.runtime.run", ("pdtool.runtime.launcher", "pdtool.runtime.worker", "pdtool.cli")),
    ("pdtool.runtime", ("pdtool.planner", "pdtool.profiler", "pdtool.cli")),  # the memory model is below both
    ("pdtool.memory", ("pdtool.planner", "pdtool.runtime", "pdtool.model", "pdtool.profiler", "pdtool.views",
                       "pdtool.cli")),
    ("pdtool.views", ("pdtool.runtime.launcher", "pdtool.runtime.worker", "pdtool.model", "pdtool.profiler",
                      "pdtool.cli")),
]


def test_no_import_back_up():
    graph = _imports(module_level_only=False)
    found = sorted({f"{module} imports {target}" for room, banned in RULES for module in MODULES if _under(module, room)
                    for target in graph[module] if _under(target, *banned)})
    assert found == []


def test_nothing_imports_the_cli():
    graph = _imports(module_level_only=False)
    assert sorted(module for module in MODULES if "pdtool.cli" in graph[module]) == []



CROSSING = {"pdtool.runtime.worker.entry", "pdtool.runtime.worker.main", "pdtool.runtime.worker.shm",
            "pdtool.runtime.worker.preload_model", "pdtool.runtime.worker.told"}
"""What crosses the process boundary: the entry a worker process runs (and its state and failure
handling), the worker itself (under torchrun or srun the launcher's process is one), the
shared-memory rings whose files the launcher removes, the forkserver's preload and the file of
modules the launcher names to it."""


def test_the_launcher_imports_from_the_worker_package_only_what_crosses_the_process_boundary():
    """Issue 36: the launcher imported 8 names from the worker package; the rules both sides read
    (tied weights: `runtime.ties`; the optimizer: `runtime.optimizers`) live below both."""
    graph = _imports(module_level_only=False)
    found = sorted({f"{module} imports {target}" for module in MODULES if _under(module, "pdtool.runtime.launcher")
                    for target in graph[module] if _under(target, "pdtool.runtime.worker") and target not in CROSSING
                    and target != "pdtool.runtime.worker"})
    assert found == []
