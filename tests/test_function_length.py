"""Short functions (issue 28 item 3): no function in pdjax/ or the entry points is over 60 lines (def to last
line, docstring included), except one whose `def` line or the line above it carries a `# long function: <why>`
comment. Parses the files only (no imports)."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = ("pdjax", "experiments")
LIMIT = 60


def _long_functions():
    for root in ROOTS:
        paths = [REPO / root] if root.endswith(".py") else sorted((REPO / root).rglob("*.py"))
        for path in paths:
            text = path.read_text()
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                size = node.end_lineno - node.lineno + 1
                said = "# long function:" in lines[node.lineno - 1] or (
                    node.lineno > 1 and "# long function:" in lines[node.lineno - 2])
                if size > LIMIT and not said:
                    yield f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({size} lines)"


def test_no_function_over_60_lines_without_a_reason():
    assert list(_long_functions()) == []
