"""The layering rules, checked on the source: engines are imported only in
ucm/connectors/ and ucm/apps/; torch only there and in the hbm device
pool; the client that every engine worker loads imports no cache code."""
import ast
import pathlib

import ucm

ROOT = pathlib.Path(ucm.__file__).parent
ENGINES = {"vllm", "sglang", "transformers"}
ENGINE_HOMES = ("connectors", "apps")


def imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def library_modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in ENGINE_HOMES:
            yield rel, path


def test_engines_are_imported_only_in_connectors_and_apps():
    offenders = {str(rel): sorted(imported_roots(path) & ENGINES) for rel, path in library_modules()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_torch_is_imported_below_the_connectors_only_by_the_hbm_device_pool():
    users = {str(rel) for rel, path in library_modules() if "torch" in imported_roots(path)}
    assert users == {"adapters/hbm.py"}


def test_the_rule_sees_an_engine_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from vllm.config import VllmConfig\n    import transformers\n")
    assert imported_roots(probe) & ENGINES == {"vllm", "transformers"}
