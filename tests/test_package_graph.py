"""The package graph stays acyclic and every package imports only what docs/architecture.md allows.

Imports are read from the source (ast), so a function-local import counts as much as a top-level
one; only imports under `if TYPE_CHECKING:` are left out (they never run). A second check runs the
proxy's modules in a fresh interpreter and asserts nothing heavy (torch, model code, stores) was loaded.
"""
from __future__ import annotations

import ast
import subprocess
import sys

from pdserve.deploy.processes import REPO
from tests.helpers.package_table import ALLOWED

PACKAGES = set(ALLOWED) | {"tests", "benchmarks"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package(module: str) -> str:
    """pdserve.engine.config -> engine (the folder); a third-party module -> its top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


def _imported(tree: ast.AST) -> set[str]:
    """Packages of every import in the tree that runs (TYPE_CHECKING blocks skipped)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(_package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "pdserve":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(_package(node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def package_graph() -> dict[str, set[str]]:
    """package -> first-party packages its modules import (itself excluded)."""
    graph: dict[str, set[str]] = {}
    for package in ALLOWED:
        deps: set[str] = set()
        for path in (REPO / package).rglob("*.py"):
            deps |= _imported(ast.parse(path.read_text(), str(path)))
        graph[package] = (deps & PACKAGES) - {package}
    return graph


def test_every_package_imports_only_what_it_may():
    graph = package_graph()
    extra = {p: sorted(deps - ALLOWED[p]) for p, deps in graph.items() if deps - ALLOWED[p]}
    assert not extra, f"imports the architecture does not allow: {extra}"
    assert not any(graph[p] & {"tests", "benchmarks"} for p in graph)


def test_benchmarks_and_tests_stay_apart():
    """benchmarks/ runs from any directory on the installed package alone: no `tests` import and no sys.path
    edit (a benchmark's siblings import as top-level modules: its folder is sys.path[0], never `benchmarks.`);
    the tests import no benchmark (what they share lives in the package)."""
    wrong = []
    for folder, banned in (("benchmarks", {"tests", "benchmarks"}), ("tests", {"benchmarks"})):
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            wrong += [f"{path.relative_to(REPO)} imports {p}" for p in sorted(_imported(tree) & banned)]
            if folder == "benchmarks":
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} edits sys.path" for node in ast.walk(tree)
                          if isinstance(node, ast.Attribute) and node.attr == "path"
                          and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not wrong, wrong


def test_tests_share_helpers_only_through_tests_helpers():
    """What several test modules use lives in tests/helpers/ (or the package), never in one of them: a test
    module may import another only to re-run one of its tests (a name starting with `test_`)."""
    wrong = []
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests.") \
                    and node.module.rsplit(".", 1)[-1].startswith("test_"):
                wrong += [f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if not a.name.startswith("test_")]
    assert not wrong, wrong


def test_the_package_graph_is_acyclic():
    graph = package_graph()
    done: set[str] = set()

    def visit(p: str, path: list[str]) -> None:
        assert p not in path, f"import cycle: {' -> '.join(path[path.index(p):] + [p])}"
        if p in done:
            return
        for q in sorted(graph.get(p, ())):
            visit(q, path + [p])
        done.add(p)

    for p in sorted(graph):
        visit(p, [])


def test_the_proxy_process_stays_light():
    """pd-proxy loads no torch, model code, connector or store client. Of the engine it loads only the
    two dependency-free dataclass modules serving shares with it: the request's SamplingParams (what
    serving.protocol validates into) and the engine config (serving.cli's option defaults)."""
    code = ("import sys, pdserve.proxy.app, pdserve.proxy.__main__; "
            "print(' '.join(sorted(m for m in sys.modules if m.removeprefix('pdserve.').split('.')[0] in "
            "('engine', 'connectors', 'kvstore', 'kernels', 'torch', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) <= {"pdserve.engine", "pdserve.engine.sampling_params", "pdserve.engine.config"}, out.stdout


def test_every_class_name_is_defined_once():
    """A name that two classes share makes a reader (and grep) guess which one a line means (there were two
    KVTransfer and two Node): every class the packages define has a name of its own, tests/ and benchmarks/
    aside."""
    where: dict[str, list[str]] = {}
    for package in ALLOWED:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def test_first_party_imports_name_the_pdserve_namespace(tmp_path):
    """Every import of a first-party package goes through `pdserve.` (a bare `import common` would take
    whatever `common` comes first on sys.path), and a stray common.py / engine.py there changes nothing."""
    bare = []
    for folder in [*ALLOWED, "tests", "benchmarks"]:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                bare += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ALLOWED]
    assert not bare, bare
    for name in ("common", "engine", "kernels", "serving"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the wrong module')\n")
    code = "from pdserve.serving import protocol; from pdserve.common import hashing; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_python_folder_is_packaged():
    """A folder of modules the wheel leaves out imports in the checkout and fails once installed: every folder
    under a top-level package that holds an __init__.py is in pyproject.toml's packages."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"pdserve." + ".".join(init.parent.relative_to(REPO).parts)
               for top in ALLOWED for init in (REPO / top).rglob("__init__.py")
               if "__pycache__" not in init.parts and "csrc" not in init.parts}
    assert folders - listed == set(), f"missing from pyproject.toml [tool.setuptools] packages: {folders - listed}"
