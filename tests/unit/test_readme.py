"""The README, checked against the code: its marked Python snippets run as
written, every `ucm ...` command it names parses with the real CLI parser,
every `kv_connector_extra_config` key and config key it names is accepted,
its tables render (one cell count per table), and it points at nothing
outside the repository."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def test_every_ucm_command_in_the_readme_exists_and_parses():
    """A name (`ucm bench trace`) must be a subcommand; a command with
    options (`ucm bench io --json`) must parse as written."""
    from ucm.cli import build_parser

    parser = build_parser()
    for argv in readme_ucm_commands():
        first_option = next((i for i, w in enumerate(argv) if w.startswith("-")), len(argv))
        _subcommand(parser, argv[:first_option])
        if first_option == len(argv):
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's way to refuse
            pytest.fail(f"`ucm {' '.join(argv)}` does not parse (exit {exc.code})")
        assert callable(args.handler)


def test_every_connector_key_in_the_readme_is_accepted():
    from ucm.connectors.vllm.settings import ConnectorSettings

    keys = set(re.findall(r"[`\"](ucm_[a-z0-9_]+)[`\"]", README))  # in code spans and the JSON
    assert {"ucm_config", "ucm_model_id", "ucm_prefetch_policy"} <= keys
    defaults = ConnectorSettings()
    for key in sorted(keys):
        field = "ucm_config" if key == "ucm_config" else key[len("ucm_"):]
        value = getattr(defaults, field)  # from_extra refuses an unknown ucm_ key with a ConfigError
        assert ConnectorSettings.from_extra({key: value}) == defaults, key
    assert {f.name for f in dataclasses.fields(ConnectorSettings)} <= {
        "ucm_config" if k == "ucm_config" else k[len("ucm_"):] for k in keys}  # and it lists them all


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


def test_every_config_key_in_the_reference_exists():
    from ucm.config.schema import UcmConfig

    rows = _table_rows(README, "## Configuration reference")
    keys = [re.findall(r"`([^`]+)`", r[0]) for r in rows[1:]]
    assert len(keys) > 15
    for spans in keys:
        _resolve(UcmConfig, spans[0].split("."))


def test_every_adapter_option_in_the_reference_exists():
    from ucm.adapters.dram import DramConfig
    from ucm.adapters.hbm import HbmConfig
    from ucm.adapters.nvme import NvmeConfig

    configs = {"dram": DramConfig, "nvme": NvmeConfig, "hbm": HbmConfig}
    rows = [r for r in _table_rows(README, "Adapter options") if r[0] in configs]
    assert len(rows) > 10
    for adapter, key, *_ in rows:
        assert key.strip("`") in configs[adapter].model_fields, (adapter, key)


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


def test_no_reference_outside_the_repository():
    for doc in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md"):
        text = doc.read_text()
        for bad in ("../", "PEERS", "/work/", "shared/data"):
            assert bad not in text, (doc.name, bad)


def test_the_repository_paths_the_readme_names_exist():
    paths = set(re.findall(r"`((?:docs|configs|ucm|tests|cpp|requirements)/[\w./-]*\w)`", README))
    assert "docs/benchmarks.md" in paths
    for p in sorted(paths):
        if "*" not in p:
            assert (ROOT / p).exists(), p


def test_the_two_commands_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "demo", "install", "system-deps"):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
