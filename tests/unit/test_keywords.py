"""Records and long calls take keywords (issue 36 item 5): a value in the wrong slot of a
positional call passes silently. Read from the sources with `ast`."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pdtool"
MOST_FIELDS, MOST_POSITIONAL = 4, 7


def _trees():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC.parent), ast.parse(path.read_text())


def _fields(node: ast.ClassDef) -> list[str]:
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)]


def test_every_dataclass_of_more_than_four_fields_is_keyword_only():
    loose = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for dec in node.decorator_list:
                call = dec if isinstance(dec, ast.Call) else None
                if not ast.unparse(call.func if call else dec).endswith("dataclass"):
                    continue
                kw_only = any(k.arg == "kw_only" and ast.unparse(k.value) == "True" for k in (call.keywords if call else ()))
                if len(_fields(node)) > MOST_FIELDS and not kw_only:
                    loose.append(f"{path}:{node.lineno} {node.name}")
    assert not loose, f"dataclasses of more than {MOST_FIELDS} fields without kw_only=True: {loose}"


def test_no_call_passes_more_than_seven_arguments_by_position():
    long = [f"{path}:{node.lineno} {ast.unparse(node.func)}" for path, tree in _trees() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and len(node.args) > MOST_POSITIONAL
            and not ast.unparse(node.func).endswith(("stage_times", "terms"))]  # the cost models' numeric kernels
    assert not long, f"calls with more than {MOST_POSITIONAL} positional arguments: {long}"
