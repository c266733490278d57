"""Connectors reach sparse attention through the package's surface
(`ucm.accelerators.sparse`, its `__all__`), never through one of its
modules: what the package keeps inside can move without a connector
noticing. Checked on the source, every import statement counted (lazy and
typing-only ones too)."""
import ast
import pathlib

import ucm
import ucm.accelerators.sparse as sparse

ROOT = pathlib.Path(ucm.__file__).parent
PACKAGE = "ucm.accelerators.sparse"


def _imports(path: pathlib.Path):
    """(module, names) of every import statement of `path`, made absolute."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return _imports_of(path.read_text(), list(rel.parts[:-1]))


def _imports_of(source: str, package: list):
    """(module, names) of every import statement of `source`, a module of
    `package` (its dotted parts), made absolute."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def _connector_modules():
    return sorted((ROOT / "connectors").rglob("*.py"))


def test_no_connector_imports_a_module_of_the_sparse_package():
    bad = {}
    for path in _connector_modules():
        hits = [m for m, _ in _imports(path) if m.startswith(PACKAGE + ".")]
        hits += [f"{m}.{n}" for m, names in _imports(path) if m == "ucm.accelerators" for n in names
                 if n == "sparse"]  # `from ucm.accelerators import sparse` then `sparse.selectors...` reaches in
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"import these from {PACKAGE} (add them to its __all__ if they belong to its surface): {bad}"


def test_what_connectors_import_from_the_package_is_its_declared_surface():
    used = {n for path in _connector_modules() for m, names in _imports(path) if m == PACKAGE for n in names}
    assert used, "no connector imports the sparse package: this test would prove nothing"
    assert used <= set(sparse.__all__), sorted(used - set(sparse.__all__))
    assert all(hasattr(sparse, n) for n in sparse.__all__)


def test_the_check_sees_lazy_and_relative_imports():
    source = ("def f():\n    from ucm.accelerators.sparse.selectors import make_selector\n"
              "from ..transformers import namespace\n")
    got = list(_imports_of(source, ["ucm", "connectors", "vllm"]))
    assert ("ucm.accelerators.sparse.selectors", ("make_selector",)) in got
    assert ("ucm.connectors.transformers", ("namespace",)) in got
