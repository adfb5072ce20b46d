"""The import structure the project keeps (packages import downward only), read from the sources (every
import, at module level or inside a function): no import circle anywhere in the repository; megatron/core
imports nothing from training, tools or the tokenizer; training never imports megatron.inference; the
checkpoint protocol and the launch scripts' helpers need only the standard library (and psutil), every import
checked."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGES = ("megatron", "analysis")
SCRIPTS = ("pretrain_gpt.py", "tools", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    found = {}
    for top in (*PACKAGES, *SCRIPTS):
        root = REPO_ROOT / top
        for path in ([root] if root.is_file() else sorted(root.rglob("*.py"))):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, name: str) -> set[str]:
    """Every module `path` imports (relative imports resolved), at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the repository's modules it imports; importing a.b.c imports the packages a and a.b too."""
    modules = sources()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imports_of(path, name):
            while imported:
                if imported in modules and imported != name and not name.startswith(imported + "."):
                    edges.add(imported)
                imported = imported.rpartition(".")[0]
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_repository():
    graph = import_graph()
    assert len(graph) > 80 and "megatron.checkpointing.save_load" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a circle like the one arguments.py and checkpointing.py once made."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_imports_nothing_from_training_tools_or_tokenizer():
    graph = import_graph()
    core = {name: edges for name, edges in graph.items() if name.startswith("megatron.core")}
    assert core
    # megatron.errors holds only the base error class and imports nothing
    offenders = {name: sorted(e for e in edges if not (e.startswith("megatron.core") or e in ("megatron",
                                                                                               "megatron.errors")))
                 for name, edges in core.items()}
    assert {name: edges for name, edges in offenders.items() if edges} == {}


def test_training_code_does_not_import_inference():
    """Training (pretrain_gpt.py and megatron/ outside megatron/inference) never imports megatron.inference."""
    graph = import_graph()
    training = {name: edges for name, edges in graph.items()
                if name == "pretrain_gpt" or (name.startswith("megatron") and "inference" not in name)}
    assert len(training) > 20
    assert {name: sorted(e for e in edges if "inference" in e) for name, edges in training.items()
            if any("inference" in e for e in edges)} == {}


STDLIB_ONLY = ["megatron.checkpointing.protocol", "megatron.checkpointing.run_folder", "megatron.launch.attempt",
               "megatron.launch.launcher_output", "megatron.flag_sources", "megatron.settings_schema",
               "megatron.layout_check"]
# the one installed package allowed: attempt.py stops the launcher's process tree with psutil (a DeepSpeed
# dependency, so present wherever a rank can start; 15 ms to import, not torch's seconds)
ALLOWED = {"megatron.launch.attempt": {"psutil"}}
# what a fresh interpreter has loaded besides the module: the top-level names of everything importing it added
NEW_MODULES = ("import sys; before = set(sys.modules); import {module}; "
               "print(' '.join(sorted({{m.partition('.')[0] for m in set(sys.modules) - before}})))")


def loaded_outside_stdlib(module: str) -> set[str]:
    """Top-level packages neither in the standard library (sys.stdlib_module_names) nor this repository's that
    importing `module` in a fresh interpreter loads."""
    result = subprocess.run([sys.executable, "-c", NEW_MODULES.format(module=module)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split()) - set(sys.stdlib_module_names) - {"megatron"}


def imported_outside_stdlib(module: str) -> dict[str, set[str]]:
    """Every import statement, at any depth (inside functions too), of `module` and of each repository module it
    reaches: those whose top-level name is neither the standard library's nor this repository's, by module."""
    modules, graph = sources(), import_graph()
    reached, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    found = {name: {imported.partition(".")[0] for imported in imports_of(modules[name], name)}
             - set(sys.stdlib_module_names) - {"megatron"} for name in reached}
    return {name: tops for name, tops in found.items() if tops}


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_what_the_launch_scripts_run_needs_only_the_standard_library(module):
    """Run before any rank starts, these must not import torch, DeepSpeed or any other installed package but
    ALLOWED's (torch and DeepSpeed cost seconds at every launch): neither at import time nor in a function they
    or the repository modules they import run."""
    allowed = ALLOWED.get(module, set())
    assert loaded_outside_stdlib(module) == allowed
    assert imported_outside_stdlib(module) == ({module: allowed} if allowed else {})


@pytest.mark.slow
def test_the_standard_library_checks_can_fail():
    assert "torch" in loaded_outside_stdlib("megatron.model.config")
    assert "torch" in imported_outside_stdlib("megatron.model.config")["megatron.model.config"]
