"""Builds ucm._native from cpp/ with pybind11 (C++17); everything else is in pyproject.toml."""
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cpp" / "src").glob("*.cpp"))
HEADERS = sorted(
    str(p.relative_to(ROOT))
    for p in [*(ROOT / "cpp" / "include" / "ucm").glob("*.hpp"), *(ROOT / "cpp" / "bindings").glob("*.hpp")]
)

native = Pybind11Extension(
    "ucm._native",
    sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cpp" / "bindings").glob("*.cpp")) + SOURCES,
    include_dirs=["cpp/include", "cpp/third_party/xxhash"],
    depends=HEADERS,  # an edited header rebuilds every source
    cxx_std=17,
    extra_compile_args=["-O3"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
