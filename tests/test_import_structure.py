"""The import structure the project keeps (packages import downward only), read from the sources (every
import, at module level or inside a function): no import circle anywhere in the repository; megatron/core
imports nothing from training, tools or the tokenizer; training never imports megatron.inference; the
checkpoint protocol and the launch scripts' helpers need only the standard library (and psutil), every import
checked."""
import ast
import os
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


def as_run(imported: str, name: str, modules: dict) -> str:
    """A script runs with its own folder first on sys.path: a bare import of a sibling is that sibling (bench/chaos.py's
    `chaos_faults` is bench.chaos_faults, tools/virtual_cluster.py's `vcluster.system` is tools.vcluster.system)."""
    folder = name.rpartition(".")[0]
    if folder in SCRIPTS and f"{folder}.{imported.partition('.')[0]}" in modules:
        return f"{folder}.{imported}"
    return imported


def import_graph() -> dict[str, set[str]]:
    """module -> the repository's modules it imports; importing a.b.c imports the packages a and a.b too."""
    modules = sources()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in (as_run(imported, name, modules) for imported in imports_of(path, name)):
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


def test_a_bench_imports_common_and_no_other_bench():
    """What benches share is in bench/common.py: a bench imports it and no other bench (bench/chaos.py its own
    second file, chaos_faults.py; bench_long_sequences.py long_sequence_levers.py, which it hands itself), and common.py imports no bench."""
    graph = import_graph()
    own_parts = {"bench.chaos": {"bench.chaos_faults"}, "bench.bench_long_sequences": {"bench.long_sequence_levers"}}
    benches = {name: {edge for edge in edges if edge.startswith("bench.")} - own_parts.get(name, set())
               for name, edges in graph.items() if name.startswith("bench.")}
    assert len(benches) > 15 and "bench.common" in benches["bench.bench_syncs"]
    assert {name: sorted(edges) for name, edges in benches.items() if edges - {"bench.common"}} == {}
    assert benches["bench.common"] == set()


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a circle like the one arguments.py and checkpointing.py once made."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def package_of(module: str) -> str:
    """The floor a module lives on: a subpackage of megatron (megatron.accounting's subpackages each their own),
    a top-level module of megatron, or the top-level script or folder."""
    parts = module.split(".")
    if parts[0] != "megatron":
        return parts[0]
    depth = 3 if parts[1:2] == ["accounting"] else 2
    for size in range(min(depth, len(parts)), 1, -1):
        if (REPO_ROOT / Path(*parts[:size])).is_dir():
            return ".".join(parts[:size])
    return module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages = {package_of(name): set() for name in graph}
    for name, edges in graph.items():
        packages[package_of(name)].update(package_of(e) for e in edges if package_of(e) != package_of(name))
    return packages


def test_no_package_imports_back_up_into_a_package_that_imports_it():
    """Packages import downward only: no circle between packages either (checkpointing once imported
    megatron.finetune, and layout_check the launch planner, which import back into them)."""
    packages = package_graph(import_graph())
    assert {"megatron.checkpointing", "megatron.accounting.predict", "megatron.launch"} <= set(packages)
    assert cycles(packages) == []


def test_the_ranks_never_import_the_launch_planner():
    """megatron/launch/ runs before any rank starts; the ranks' code (megatron outside launch/, pretrain_gpt.py)
    reaches the launcher's environment through megatron.runtime, never through launch/."""
    graph = import_graph()
    ranks = {name: sorted(e for e in edges if e.startswith("megatron.launch")) for name, edges in graph.items()
             if name == "pretrain_gpt" or (name.startswith("megatron") and not name.startswith("megatron.launch"))}
    assert {name: edges for name, edges in ranks.items() if edges} == {}


def test_the_package_circle_finder_sees_a_circle_between_packages():
    graph = {"megatron.checkpointing.save_load": {"megatron.checkpointing.finetune_x"},
             "megatron.checkpointing.finetune_x": {"megatron.training"}, "megatron.training": {"megatron.checkpointing"},
             "megatron.checkpointing": set()}
    assert cycles(package_graph(graph)) == [["megatron.checkpointing", "megatron.training"]]


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


# ---- the scripts import without editing sys.path ----

# tools/zero_plan.py still puts the repository root on sys.path: its rewrite (issue 57) takes the line out


def sys_path_edits(source: str) -> list[int]:
    """Lines that change sys.path: a call of one of its methods (insert, append, extend, ...), an assignment to it or
    to a slice of it, an augmented assignment."""
    def is_sys_path(node) -> bool:
        node = node.value if isinstance(node, ast.Subscript) else node
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(is_sys_path(target) for target in node.targets):
            lines.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and is_sys_path(node.target):
            lines.append(node.lineno)
    return sorted(lines)


def test_analysis_and_tools_do_not_edit_sys_path():
    """Their scripts import `megatron`, `analysis` and `tools` as installed packages (setup.py) and a sibling
    (tools/virtual_cluster.py's vcluster) from their own folder, first on sys.path when a script runs."""
    files = sorted(path for top in ("analysis", "tools") for path in (REPO_ROOT / top).rglob("*.py"))
    assert len(files) > 30
    edits = {str(path.relative_to(REPO_ROOT)): sys_path_edits(path.read_text()) for path in files}
    assert {name: lines for name, lines in edits.items() if lines} == {}


def test_the_sys_path_check_can_fail():
    source = ("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\nsys.path = []\n"
              "sys.path.append('w')\nprint(sys.path[0])\nsys.argv.append('v')\n")
    assert sys_path_edits(source) == [2, 3, 4, 5, 6]


def clean_run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` with this interpreter in `cwd`, its environment only PATH, HOME and LANG: no PYTHONPATH."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def installed_here(tmp_path_factory):
    """Skip unless the interpreter's zero-lab is this checkout's (a worktree beside another checkout's install runs
    another checkout's packages); fail, naming the fix, where the install predates the analysis and tools packages."""
    where = ("import importlib.util as u\nfor name in ('megatron', 'analysis', 'tools'):\n"
             "    spec = u.find_spec(name)\n    print(name, spec and spec.submodule_search_locations[0])\n")
    done = clean_run("-c", where, cwd=tmp_path_factory.mktemp("elsewhere"))
    assert done.returncode == 0, done.stderr
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    if found["megatron"] != str(REPO_ROOT / "megatron"):
        pytest.skip(f"zero-lab is installed from {found['megatron']}, not this checkout: pip install -e . here")
    assert found == {name: str(REPO_ROOT / name) for name in found}, \
        f"{found}: the install predates the analysis and tools packages: run bash scripts/setup.sh again"


SCRIPTS_RUN_ANYWHERE = sorted(str(path.relative_to(REPO_ROOT)) for path in (
    *(REPO_ROOT / "tools").glob("*.py"), *(REPO_ROOT / "analysis" / name for name in ("summarize.py", "reference.py")))
    if path.name != "__init__.py")


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS_RUN_ANYWHERE)
def test_each_script_runs_from_another_folder_without_pythonpath(script, installed_here, tmp_path):
    """`python PATH/script --help` from a folder outside the repository with no PYTHONPATH: what a fresh checkout's
    `bash scripts/main.sh` leaves is all a script needs to import."""
    done = clean_run(str(REPO_ROOT / script), "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")
