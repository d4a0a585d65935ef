"""The package's rules of size and shape (docs/contributing.md): small modules and functions, no import cycle,
no private name imported across modules. Read from the source with `ast`; nothing is imported. An
`importlib.import_module(...)` call that names a module with a string (a literal or a module-level constant) counts
as an import, so that a cycle cannot hide behind it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_tev"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (`hf_tev.x.__init__` is `hf_tev.x`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def string_constants(tree: ast.Module) -> dict[str, str]:
    """The module-level string constants of a file (`NAME = "..."`, annotated or not)."""
    found = {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.update((target.id, value.value) for target in targets if isinstance(target, ast.Name))
    return found


def import_module_call(node: ast.Call, name: str, package: str, constants: dict) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` call imports, when the file says which: a
    string literal or a module-level string constant; a relative name is resolved against its package argument
    when that is `__name__`, `__package__` or a string. None for any other call."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called != "import_module" or not node.args:
        return None

    def text(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        return {"__name__": name, "__package__": package, **constants}.get(getattr(arg, "id", None))

    module = text(node.args[0])
    if module is None or not module.startswith("."):
        return module
    anchors = node.args[1:2] + [k.value for k in node.keywords if k.arg == "package"]
    anchor = text(anchors[0]) if anchors else None
    if anchor is None:
        return None
    level = len(module) - len(module.lstrip("."))
    base = anchor.split(".")[: len(anchor.split(".")) - level + 1]
    return ".".join(base + ([module[level:]] if module[level:] else []))


def imports(name: str, path: Path, known: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import of `hf_tev` modules in the file, at any depth, `import_module`
    calls that name their module included."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text())
    constants = string_constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (module := import_module_call(node, name, package, constants)):
            found.append((module, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            # `from . import x` imports module x when there is one
            for alias in names:
                if f"{module}.{alias}" in known:
                    found.append((f"{module}.{alias}", []))
            found.append((module, [n for n in names if f"{module}.{n}" not in known]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return [(module, names) for module, names in found if module in known]


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_longer_than_the_limit():
    long = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [
        f"{name} imports {module}.{n}"
        for name, path in known.items()
        for module, names in imports(name, path, known)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not private, private


def test_there_is_no_import_cycle():
    known = modules()
    # an import of a package's own ancestor runs no new code (the ancestor is imported first): not an edge
    edges = {
        name: {m for m, _ in imports(name, path, known) if m != name and not name.startswith(m + ".")}
        for name, path in known.items()
    }
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for child in sorted(edges[node]):
            if state.get(child) == "open":
                cycles.append(stack[stack.index(child) :] + [child])
            elif child not in state:
                visit(child, stack + [child])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"


def test_an_import_module_call_naming_its_module_is_an_import(tmp_path):
    """`import_module` with a string literal, a module-level constant, or a relative name and its package: edges
    the cycle check sees (the drafter's modules once hid a cycle behind one); a name computed at run time is not."""
    source = tmp_path / "module.py"
    source.write_text(
        "import importlib\n"
        "from importlib import import_module\n"
        'LATER = "hf_tev.verify"\n'
        "def f(name):\n"
        '    importlib.import_module("hf_tev.tree")\n'
        "    import_module(LATER)\n"
        '    importlib.import_module("..config", __package__)\n'
        '    importlib.import_module("..lookup", package="hf_tev.generation")\n'
        "    importlib.import_module(f'hf_tev.{name}')\n"
    )
    known = modules()
    found = [module for module, _ in imports("hf_tev.generation.module", source, known)]
    assert sorted(found) == ["hf_tev.config", "hf_tev.lookup", "hf_tev.tree", "hf_tev.verify"]
