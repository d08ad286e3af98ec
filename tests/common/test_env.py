"""common/env.py is the one place PDSERVE_* variables are declared and read, and docs/configuration.md's
table is its table."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from pdserve.common import env
from pdserve.deploy.processes import REPO
from tests.helpers.package_table import ALLOWED

NAME = re.compile(r"PDSERVE_[A-Z0-9_]+")


def _docs_table() -> str:
    """The first table of docs/configuration.md's "Environment variables" section."""
    section = (REPO / "docs" / "configuration.md").read_text().split("## Environment variables\n", 1)[1]
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:end])


def test_the_docs_table_is_the_declared_variables():
    assert _docs_table() == env.markdown_table(), "regenerate it: python -m pdserve.common.env"


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_module_but_env_names_a_variable():
    """A variable's name in code (os.environ.get("PDSERVE_..."), a default's source) lives only in
    common/env.py; the rest read env.KERNELS and friends, so no reader has its own default or spelling."""
    elsewhere = [f"{path.relative_to(REPO)}:{line}: {text}" for package in ALLOWED
                 for path in sorted((REPO / package).rglob("*.py")) if path != REPO / "common" / "env.py"
                 for line, text in _code_strings(path) if NAME.fullmatch(text)]
    assert not elsewhere, elsewhere


def test_every_declared_variable_is_read_somewhere_and_named_as_declared():
    sources = "\n".join(path.read_text() for package in ALLOWED for path in (REPO / package).rglob("*.py")
                        if path != REPO / "common" / "env.py")
    attrs = {name: var for name, var in vars(env).items() if isinstance(var, env.Variable)}
    assert sorted(attrs.values(), key=lambda v: v.name) == sorted(env.VARIABLES, key=lambda v: v.name)
    for attr, var in attrs.items():
        assert NAME.fullmatch(var.name) and var.doc and var.kind, var
        assert f"env.{attr}" in sources, f"{var.name} is declared but nothing reads it"


def test_accessors(monkeypatch, tmp_path):
    monkeypatch.delenv(env.KERNELS.name, raising=False)
    assert env.value(env.KERNELS) == "auto"
    monkeypatch.setenv(env.KERNELS.name, "")
    assert env.value(env.KERNELS) == ""  # an empty value is a value: its reader decides (kernels refuse it)
    for text, on in (("0", False), (" Off ", False), ("no", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(env.CONFIGURE_LOGGING.name, text)
        assert env.flag(env.CONFIGURE_LOGGING) is on
    monkeypatch.delenv(env.CONFIGURE_LOGGING.name)
    assert env.flag(env.CONFIGURE_LOGGING)
    for text, key in ((None, None), ("", None), ("k", "k")):
        if text is None:
            monkeypatch.delenv(env.API_KEY.name, raising=False)
        else:
            monkeypatch.setenv(env.API_KEY.name, text)
        assert env.optional(env.API_KEY) == key
    monkeypatch.setenv(env.CACHE_DIR.name, "")
    assert env.path(env.CACHE_DIR) == Path.home() / ".cache" / "pdserve"
    monkeypatch.setenv(env.CACHE_DIR.name, str(tmp_path))
    assert env.path(env.CACHE_DIR) == tmp_path
