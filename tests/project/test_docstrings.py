"""Every public function, method and class of the package has a docstring (pure Python, ast only).

Public: a name not starting with "_", at module level or inside a public class (methods,
properties and `forward` included). Nested functions are private to their enclosing one.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "subnet_ext"


def missing_docstrings(root: pathlib.Path = ROOT) -> list[str]:
    """'path:line: Qualified.name' of each public function or class without a docstring."""
    out = []

    def walk(node, prefix, path):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if child.name.startswith("_"):
                continue
            if ast.get_docstring(child) is None:
                out.append(f"{path}:{child.lineno}: {prefix}{child.name}")
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.", path)

    for path in sorted(root.rglob("*.py")):
        walk(ast.parse(path.read_text(), filename=str(path)), "", path.relative_to(root.parent).as_posix())
    return out


def test_every_public_function_and_class_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, (f"{len(missing)} public function(s)/class(es) without a docstring (say what it does and, "
                         "where tensors pass, their shapes and units):\n  " + "\n  ".join(missing))


def test_the_check_finds_a_missing_docstring(tmp_path):
    (tmp_path / "m.py").write_text('"""doc"""\n\n\nclass A:\n    """doc"""\n\n    def forward(self, x):\n'
                                   '        return x\n\n    def _private(self):\n        return 1\n\n\n'
                                   'def f():\n    def inner():\n        pass\n    return inner\n')
    where = f"{tmp_path.name}/m.py"
    assert missing_docstrings(tmp_path) == [f"{where}:7: A.forward", f"{where}:14: f"]
