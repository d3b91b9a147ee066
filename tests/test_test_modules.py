"""The test modules themselves: none may switch Triton's interpreter on for the whole process.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` only where CUDA is missing.  A test module
that set it at import (as two did until a CUDA run found it) turns the interpreter on in every
test its pytest-xdist worker runs afterwards, and on a GPU machine Inductor's own Triton kernels
then fail under it ("Cannot call @triton.jit'd outside of the scope of a kernel").
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).parent
CHILD_SCRIPTS = {"inductor_trace.py"}  # run in a child process, never imported by pytest


def _sets_interpreter(statement: ast.stmt) -> bool:
    """A module-level ``os.environ[...] = ...`` / ``os.environ.setdefault(...)`` naming TRITON_INTERPRET."""
    if isinstance(statement, ast.Assign | ast.Expr):
        return "TRITON_INTERPRET" in ast.unparse(statement) and "environ" in ast.unparse(statement)
    return False


def test_no_test_module_sets_the_interpreter_at_import():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in CHILD_SCRIPTS or path.name == "conftest.py" and path.parent == TESTS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(TESTS)}:{node.lineno}" for node in tree.body if _sets_interpreter(node)]
    assert not offenders, f"module-level TRITON_INTERPRET set (leave it to tests/conftest.py): {offenders}"


def test_the_check_sees_the_form_that_was_there():
    source = 'import os\nos.environ.setdefault("TRITON_INTERPRET", "1")\nos.environ["TRITON_INTERPRET"] = "1"\n'
    tree = ast.parse(source)
    assert [_sets_interpreter(node) for node in tree.body] == [False, True, True]
