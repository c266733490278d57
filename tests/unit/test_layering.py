"""The layers, checked on the source (every import statement counts, lazy
and typing-only ones included):

- engines (vLLM, SGLang, transformers; Dynamo's runtime) are imported only in ucm/connectors/,
  the engine benches (ucm/bench/engines/) and the applications (ucm/apps/:
  the demo and model preparation); torch below them only by the hbm tier;
- adapters import nothing above them: the errors, buffers and keys, the size
  strings and validation messages of the config, the native module, other
  adapters;
- the tier stack imports only the plan vocabulary from placement;
- placement imports no adapter and nothing of the cache or the tiers;
- the client that every engine process loads imports nothing of the server
  or the cache;
- no module imports a module that imports it back (no import cycle);
- at most 8 modules lie loose in ucm/.
"""
import ast
import pathlib

import pytest

import ucm

ROOT = pathlib.Path(ucm.__file__).parent
ENGINES = {"vllm", "sglang", "transformers", "dynamo"}  # dynamo: NVIDIA Dynamo's runtime (a router, not an engine)
ENGINE_HOMES = ("connectors/", "bench/engines/", "apps/")


def imports_of(tree: ast.AST, package: list[str]) -> set[str]:
    """Every module an import statement of `tree` names, made absolute for a
    module in `package` (its dotted parts)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def imported_modules(path: pathlib.Path) -> set[str]:
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return imports_of(ast.parse(path.read_text(), str(path)), package)


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def modules_under(prefix: str):
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(prefix):
            yield rel, path


def ucm_imports(path: pathlib.Path) -> set[str]:
    """The ucm modules `path` imports that exist (a `from pkg import name`
    of a non-module name counts as the package)."""
    known = {module_name(p) for p in ROOT.rglob("*.py")}
    out = set()
    for m in imported_modules(path):
        while m and m not in known and "." in m:
            m = m.rsplit(".", 1)[0]
        if m in known and m != "ucm":
            out.add(m)
    return out


def offenders(prefix: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Per module under `prefix`, the ucm modules it imports outside `allowed`
    (a prefix ending in '.' allows a package's modules)."""
    bad = {}
    for rel, path in modules_under(prefix):
        wrong = sorted(m for m in ucm_imports(path)
                       if not any(m == a or (a.endswith(".") and m.startswith(a)) for a in allowed))
        if wrong:
            bad[rel] = wrong
    return bad


def test_engines_are_imported_only_in_connectors_engine_benches_and_apps():
    found = {rel: sorted({m.split(".")[0] for m in imported_modules(path)} & ENGINES)
             for rel, path in modules_under("")}
    assert {k: v for k, v in found.items() if v and not k.startswith(ENGINE_HOMES)} == {}


def test_torch_is_imported_below_the_engines_only_by_the_hbm_tier():
    users = {rel for rel, path in modules_under("")
             if not rel.startswith(ENGINE_HOMES) and "torch" in {m.split(".")[0] for m in imported_modules(path)}}
    assert users == {"adapters/hbm.py"}


def test_adapters_import_nothing_above_them():
    assert offenders("adapters/", ("ucm.adapters.", "ucm.adapters", "ucm.errors", "ucm.buffers", "ucm.keys",
                                   "ucm._native", "ucm.config.sizes", "ucm.config.validation")) == {}


def test_the_tier_stack_imports_only_the_plan_vocabulary_from_placement():
    bad = {rel: [m for m in mods if m.startswith("ucm.placement") and m != "ucm.placement.plans"]
           for rel, mods in offenders("tiers/", ()).items()}
    assert {k: v for k, v in bad.items() if v and not k.startswith("tiers/executor")} == {}


def test_placement_imports_no_adapter_and_nothing_of_the_cache_or_the_tiers():
    bad = {rel: [m for m in mods if m.startswith(("ucm.adapters", "ucm.cache", "ucm.tiers", "ucm.service"))]
           for rel, mods in offenders("placement/", ()).items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_client_imports_nothing_of_the_server_or_the_cache():
    bad = {rel: [m for m in mods if m.startswith(("ucm.service.server", "ucm.cache", "ucm.tiers", "ucm.placement"))]
           for rel, mods in offenders("service/client/", ()).items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_no_import_cycle():
    graph = {module_name(p): ucm_imports(p) for p in ROOT.rglob("*.py")}
    for m, deps in graph.items():  # a module's own package __init__ is not an edge back
        deps.discard(m)
        deps.difference_update({d for d in deps if m.startswith(d + ".") and (ROOT.parent / d.replace(".", "/")).is_dir()})
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_at_most_eight_modules_lie_loose_in_ucm():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(loose) <= 8, loose


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from vllm.config import VllmConfig\n    import transformers\n", {"vllm", "transformers"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang.srt\n", {"sglang"}),
])
def test_the_rules_see_lazy_and_typing_imports(source, expected):
    assert {m.split(".")[0] for m in imports_of(ast.parse(source), ["ucm"])} & ENGINES == expected


def test_relative_imports_are_made_absolute():
    assert imports_of(ast.parse("from ..plans import Op\n"), ["ucm", "placement", "policies"]) >= {"ucm.placement.plans"}
