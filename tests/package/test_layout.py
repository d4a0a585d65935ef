"""The package's rules of size and shape (docs/contributing.md): small modules and functions, no import cycle,
no private name imported across modules. Read from the source with `ast`; nothing is imported."""

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


def imports(name: str, path: Path, known: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import of `hf_tev` modules in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
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
