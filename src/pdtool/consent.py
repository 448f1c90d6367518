"""Consent before code: which `pkg.module:function` names pd may import and call.

Plan, profile and checkpoint files are data that people pass around, yet a plan names a model
factory that `pd train` calls with the plan's keyword arguments. A list of refused packages
cannot make that safe (any installed function that evaluates a string or touches a path is a
weapon), so pd calls a function only when someone who may run code consented to it:

1. **the user named it on the command line** (`pd profile -m SPEC`, `pd train -m SPEC`,
   `--data SPEC`): `given=True`;
2. **it lives in the experiment folder**: the module's file is in the current folder (or below
   it), and not inside an installed package that happens to live there (a virtual environment,
   a `src/` folder on `sys.path`);
3. **its author marked it** as a factory: the `@pdtool.factory` decorator on its definition, or
   an entry point of the package's metadata in the group `pdtool.models` (`pdtool.datasets` for
   data) whose value is the spec (the Python convention for plugins; see docs/security.md), listed by
   a distribution installed outside the experiment folder (a `.dist-info` folder in it is data
   like any other file there: it consents only to a module that is itself a file of the folder).

Everything is decided *before* the module is imported: the module's file is found the way
`import` would find it (the finders of `sys.meta_path`, parents included) without running it,
and the decorator is read from the source with `ast` (following `from X import f`
re-exports). A marked function is checked once more after the import (`checked_after_import`),
so that a later assignment to the same name cannot slip through. Pure standard library.
"""
from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from .errors import ModelError, PdtoolError

MARK = "__pdtool_factory__"
"""The attribute `factory` sets on a function it marks."""

GROUPS = {"model": "pdtool.models", "data": "pdtool.datasets"}
"""The entry-point group that marks factories of each kind."""

_REEXPORT_DEPTH = 4  # `from X import f` hops followed when looking for a function's definition

F = TypeVar("F", bound=Callable)


def factory(function: F) -> F:
    """Mark `function` as a pdtool factory: plan and profile files may then name it.

    Use it on the function that builds a model (or a dataset): `@pdtool.factory`. It changes
    nothing else about the function."""
    if not callable(function) or not hasattr(function, "__code__"):
        raise TypeError("@pdtool.factory marks a function (def ...); put it on the function that builds the model")
    setattr(function, MARK, True)
    return function


@dataclass(frozen=True)
class Consent:
    """Why pd may import and call a spec: `how` says it in words; `marked` asks the imported
    function to carry the mark too; `origin` is the experiment folder's file it runs, if any."""

    how: str
    marked: bool = False
    origin: str | None = None

    def checked_after_import(self, spec: str, function: object, error: type[PdtoolError], what: str) -> None:
        """Refuse a function that the source marked but the import replaced (e.g. `f = os.system`)."""
        if self.marked and getattr(function, MARK, False) is not True:
            raise error(f"{what} {spec!r}: the @pdtool.factory decorator in its source is not on the function its "
                        f"module finally defines under that name, so pd will not call it; fix the module")


def import_path() -> None:
    """Make the current folder importable, after every installed package (as `python -m` does,
    but never shadowing an installed package with a same-named file of the current folder)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def consent(spec: str, *, given: bool, what: str = "model", error: type[PdtoolError] = ModelError,
            flag: str = "-m") -> Consent:
    """Whether pd may import and call `spec` (`module:function`), without importing anything.

    `given`: the user typed the spec on this command line. Raises one `error` line, saying how
    to consent, when none of the module docstring's three rules holds."""
    if given:
        return Consent("named on the command line")
    module_name, _, attr = spec.partition(":")
    if _registered(spec, what):
        return Consent(f"a {GROUPS.get(what, GROUPS['model'])} entry point")
    import_path()
    found = _find(module_name)
    if isinstance(found, str):  # nothing to import: say so, as the import would
        raise error(f"{what} {spec!r}: cannot import {found!r}; check the module path, install its package, or run "
                    "from the folder that holds it")
    local = _in_experiment_folder(found.origin) if found.origin else None
    if local:
        return Consent("a file of the experiment folder", origin=local)
    if "." not in attr and _marked(found, attr, _REEXPORT_DEPTH):
        return Consent("marked @pdtool.factory", marked=True)
    where = found.origin or "a namespace package"  # a file outside the experiment folder, or "built-in"/"frozen"
    raise error(
        f"{what} {spec!r} is not a pdtool {what} factory ({where}: no @pdtool.factory mark, no "
        f"{GROUPS.get(what, GROUPS['model'])} entry point, not a file of the experiment folder {os.getcwd()}), so pd "
        f"imports and calls nothing; if you trust it, name it yourself ({flag} {spec}), or mark the function with "
        "@pdtool.factory where it is defined")


def _registered(spec: str, what: str) -> bool:
    """Whether an installed package's metadata lists `spec` as an entry point of `what`'s group."""
    try:
        points = importlib.metadata.entry_points(group=GROUPS.get(what, GROUPS["model"]))
    except Exception:  # noqa: BLE001 - a broken distribution's metadata marks nothing
        return False
    return any(point.value.replace(" ", "") == spec and _installed(point) for point in points)


def _installed(point) -> bool:
    """Whether the distribution listing entry point `point` is installed outside the experiment
    folder (or in a Python installation inside it: a `.venv`), or the point's module is itself a
    file of the folder; a `.dist-info` folder that a cloned repository carries is neither."""
    location = getattr(getattr(point, "dist", None), "_path", None)  # the .dist-info folder
    if location is None:
        return True  # a distribution of another finder than the file system's
    real = os.path.realpath(location)
    folder = os.path.realpath(os.getcwd())
    if not real.startswith(folder + os.sep):
        return True
    for prefix in {sys.prefix, sys.exec_prefix, sys.base_prefix}:
        root = os.path.realpath(prefix)
        if root != folder and real.startswith(root + os.sep):
            return True
    found = _find(point.value.partition(":")[0].strip())
    return not isinstance(found, str) and bool(found.origin) and _in_experiment_folder(found.origin) is not None


def _find(module_name: str) -> importlib.machinery.ModuleSpec | str:
    """The spec `import module_name` would load, found without running the module or its parents
    (each is looked up by the finders of `sys.meta_path` in the search path of the one before;
    an imported one's own spec is used as it is); or the name of the first part that is missing."""
    parts = module_name.split(".")
    if not all(part.isidentifier() for part in parts):
        return module_name
    found, path = None, None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        module = sys.modules.get(name)
        found = getattr(module, "__spec__", None) if module is not None else _find_spec(name, path)
        if found is None:
            return name
        path = found.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return ".".join(parts[: i + 2])  # a module, not a package: it has no submodules
    return found


def _find_spec(name: str, path) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            found = find(name, list(path) if path is not None else None)
        except (ImportError, ValueError, AttributeError, TypeError):
            continue
        if found is not None:
            return found
    return None


def _in_experiment_folder(origin: str) -> str | None:
    """`origin` relative to the current folder when it is a file of it that no installed package
    holds (a folder on `sys.path` or a Python prefix inside the current folder), else None."""
    if not os.path.isfile(origin):
        return None
    folder = os.path.realpath(os.getcwd())
    real = os.path.realpath(origin)
    if not real.startswith(folder + os.sep):
        return None
    for other in list(sys.path) + [sys.prefix, sys.exec_prefix, sys.base_prefix]:
        root = os.path.realpath(other) if other else folder
        if root != folder and root.startswith(folder + os.sep) and real.startswith(root + os.sep):
            return None  # e.g. ./.venv/lib/.../site-packages or ./src of an installed package
    return os.path.relpath(real, folder)


def _marked(found: importlib.machinery.ModuleSpec, attr: str, hops: int) -> bool:
    """Whether `found`'s source defines `attr` with the @pdtool.factory decorator, directly or
    through `from X import attr` (up to `hops` re-exports)."""
    tree = _source_tree(found)
    if tree is None:
        return False
    pdtool_names = _names_bound_to_pdtool(tree, found)
    for node in reversed(tree.body):  # the last binding of the name is what the import leaves
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return any(_is_mark(decorator, pdtool_names) for decorator in node.decorator_list)
        if isinstance(node, ast.ClassDef) and node.name == attr:
            return False  # a class, not a function
        if isinstance(node, ast.ImportFrom) and hops > 0:
            for alias in node.names:
                if (alias.asname or alias.name) == attr:
                    source = _find(_absolute(node, found))
                    return not isinstance(source, str) and _marked(source, alias.name, hops - 1)
    return False


def _source_tree(found: importlib.machinery.ModuleSpec) -> ast.Module | None:
    origin = found.origin
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    try:
        return ast.parse(Path(origin).read_text(encoding="utf-8"), origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _absolute(node: ast.ImportFrom, found: importlib.machinery.ModuleSpec) -> str:
    """The absolute module name of a `from ... import` in the module `found`."""
    if not node.level:
        return node.module or ""
    package = found.name if found.submodule_search_locations is not None else found.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts) or not package:
        return ""
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _names_bound_to_pdtool(tree: ast.Module, found: importlib.machinery.ModuleSpec) -> dict[str, str]:
    """Top-level names the module binds to pdtool or its `factory`: name -> 'module' or 'factory'."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pdtool" or (alias.name.startswith("pdtool.") and not alias.asname):
                    names[(alias.asname or alias.name).split(".")[0]] = "module"
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, found)
            if source == "pdtool" or source.startswith("pdtool."):
                for alias in node.names:
                    if alias.name == "factory":
                        names[alias.asname or alias.name] = "factory"
    return names


def _is_mark(decorator: ast.expr, pdtool_names: dict[str, str]) -> bool:
    """`@factory` (imported from pdtool) or `@pdtool.factory` / `@pdtool.consent.factory`."""
    if isinstance(decorator, ast.Name):
        return pdtool_names.get(decorator.id) == "factory"
    if isinstance(decorator, ast.Attribute) and decorator.attr == "factory":
        root = decorator.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and pdtool_names.get(root.id) == "module"
    return False
