"""Imports point down the layers: ground floor (config, sampling_params, kv_spec, args, kernels) -> attention_backends,
graphs, distributed -> models -> runner -> executor (the processes that run ModelRunners) -> engine -> llm, serve,
bench, cli. A module may import its own layer and those below, never one above; kernels import nothing from ember, and
attention_backends.triton_common nothing but itself and kernels. The package root (the public API) sits with llm;
only its `__version__` may be read from below. Every import counts, lazy ones inside functions included.

No module-level import circles either: a module that imports, through others, a module that imports it back works
only while the order of first imports happens to suit it. Imports inside functions and under `if TYPE_CHECKING:`
run later or never, and do not count there."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ember"

LAYERS = {
    "config": 0, "sampling_params": 0, "kv_spec": 0, "args": 0, "kernels": 0, "compat": 0, "inputs": 0,
    "profiling": 0, "quant": 0, "speculative_config": 0,
    "attention_backends": 1, "graphs": 1, "distributed": 1,
    "models": 2,
    "runner": 3, "spec_decode": 3,
    "executor": 4,                           # make_executor and the tensor-parallel workers: they run ModelRunners
    "engine": 5,
    "llm": 6, "chat_input": 6, "tokenizer_args": 6, "serve": 6, "bench": 6, "cli": 6,
    "": 6, "__main__": 6,                    # the package root (the public API) and `python -m ember`
}
SELF_CONTAINED = {"kernels"}             # may import nothing from ember outside themselves
# packages that may import nothing from ember outside themselves but the packages named
CONFINED = {"ember.attention_backends.triton_common": ("ember.kernels",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _part(module: str) -> str:
    """The key of LAYERS an `ember.` module name falls under: its top-level part ("" for the package root), or
    `part.module` where LAYERS names that module apart."""
    parts = module.split(".")
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in LAYERS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every ember import in a file."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "ember" and all(a.name == "__version__" for a in node.names):
                continue          # the version string is plain metadata, readable from any layer
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name == "ember" or name.startswith("ember.")]


def upward_imports(root: Path) -> list[str]:
    """Every import in the package at `root` that points to a higher layer, or out of a self-contained one."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        part = _part(module)
        if part not in LAYERS:
            problems.append(f"{path}: {module} is in no layer; add {part!r} to LAYERS in {Path(__file__).name}")
            continue
        for line, target in _imports(path, module):
            to = _part(target)
            if to not in LAYERS:
                problems.append(f"{path}:{line}: imports {target}, which is in no layer")
            elif LAYERS[to] > LAYERS[part]:
                problems.append(f"{path}:{line}: {module} (layer {LAYERS[part]}) imports {target} "
                                f"(layer {LAYERS[to]})")
            elif part in SELF_CONTAINED and to != part:
                problems.append(f"{path}:{line}: {module} must import nothing from ember, but imports {target}")
            else:
                for package, allowed in CONFINED.items():
                    if _within(module, package) and not any(_within(target, p) for p in (package, *allowed)):
                        problems.append(f"{path}:{line}: {module} may import only {package} and {allowed}, but "
                                        f"imports {target}")
    return problems


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: not those inside functions or under `if TYPE_CHECKING:`."""
    found = []

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            else:
                visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_graph(root: Path) -> dict[str, list[str]]:
    """Module -> the package's modules it imports at module level. `from a import b` names the module a.b where
    there is one, else a; the packages above an imported module (which Python imports first) are left out."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[:len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[module] = sorted(t for t in targets if t in modules and t != module)
    return graph


def import_circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One circle a -> b -> ... -> a through each group of modules that import each other (Tarjan's strongly
    connected components, then a path around each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(set(group))

    for v in graph:
        if v not in index:
            connect(v)
    return [_circle_through(graph, group) for group in groups]


def _circle_through(graph: dict[str, list[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to it, inside the group (breadth first: a shortest one)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in group and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def test_ember_has_no_import_circles():
    circles = import_circles(module_graph(ROOT))
    assert circles == [], "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("files, circle", [
    ({"engine/a.py": "from ember.engine.b import x\n", "engine/b.py": "from ember.engine import c\n",
      "engine/c.py": "import ember.engine.a\n"},
     ["ember.engine.a", "ember.engine.b", "ember.engine.c", "ember.engine.a"]),
    ({"engine/a.py": "from .b import x\n", "engine/b.py": "class B:\n    from . import a\n"},
     ["ember.engine.a", "ember.engine.b", "ember.engine.a"]),                    # a class body runs at import
], ids=["absolute", "relative"])
def test_an_import_circle_is_reported(tmp_path, files, circle):
    root = _write(tmp_path, {"__init__.py": "", "engine/__init__.py": "", **files})
    assert import_circles(module_graph(root)) == [circle]


def test_lazy_and_type_checking_imports_make_no_circle(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "engine/__init__.py": "",
                             "engine/a.py": "from ember.engine.b import x\n",
                             "engine/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from ember.engine.a import y\nelse:\n    import os\n"
                                            "def f():\n    from ember.engine import a\n"})
    graph = module_graph(root)
    assert graph["ember.engine.a"] == ["ember.engine.b"] and graph["ember.engine.b"] == []
    assert import_circles(graph) == []


def test_ember_imports_point_down():
    assert upward_imports(ROOT) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "ember" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "ember"


@pytest.mark.parametrize("files, culprit", [
    ({"models/llama.py": "from ember.runner.step_input import StepInput\n"}, "models/llama.py:1"),
    ({"runner/x.py": "def f():\n    import ember.engine.scheduler\n"}, "runner/x.py:2"),              # lazy
    ({"runner/sub/x.py": "from ...engine import scheduler\n"}, "runner/sub/x.py:1"),                 # relative
    ({"kernels/k.py": "from ember.config import EngineConfig\n"}, "kernels/k.py:1"),                 # self-contained
    ({"graphs/g.py": "from ember import LLM\n"}, "graphs/g.py:1"),                                    # package root
    ({"newthing.py": "x = 1\n"}, "newthing.py"),                                                      # no layer
    ({"distributed/w.py": "def f():\n    from ember.runner.model_runner import ModelRunner\n"},
     "distributed/w.py:2"),                                                   # collectives below the runner
    ({"executor/x.py": "from ember.engine.core import EngineCore\n"}, "executor/x.py:1"),           # below the engine
    ({"attention_backends/triton_common/t.py": "from ..base import AttentionBackend\n"},
     "attention_backends/triton_common/t.py:1"),                                                    # confined
], ids=["upward", "lazy", "relative", "kernels", "root", "unlayered", "distributed", "executor", "confined"])
def test_an_upward_import_is_reported(tmp_path, files, culprit):
    root = _write(tmp_path, {"__init__.py": "", "engine/__init__.py": "", "config.py": "", **files})
    problems = upward_imports(root)
    assert len(problems) == 1 and culprit in problems[0], problems


def test_downward_and_sideways_imports_pass(tmp_path):
    root = _write(tmp_path, {"__init__.py": "from ember.llm import LLM\n",
                             "engine/e.py": "from ember.runner.step_input import StepInput\nfrom . import f\n",
                             "engine/core.py": "from ember.executor import make_executor\n",
                             "executor/m.py": "from ember.runner.model_runner import ModelRunner\n"
                                              "from ember.distributed.channel import RingWriter\n",
                             "graphs/g.py": "from ember.attention_backends.op import x\n",
                             "kernels/k.py": "from ember.kernels.other import y\n",
                             "attention_backends/triton_common/t.py": "from ember.kernels.pdl import x\nfrom . import u\n"})
    assert upward_imports(root) == []
