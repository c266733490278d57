"""Builds ucm._native from cpp/ with pybind11 (C++17); everything else is in pyproject.toml.

The sources compile in parallel (one job per CPU; UCM_BUILD_JOBS sets another
count). UCM_NATIVE_PREBUILT=1 makes an editable install use the
ucm/_native*.so already built in this tree for the same Python instead of
compiling it again (the Makefile's SGLang venv next to the main one)."""
import os
import sysconfig
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).parent
ParallelCompile("UCM_BUILD_JOBS").install()
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

if os.environ.get("UCM_NATIVE_PREBUILT") == "1":
    built = ROOT / "ucm" / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not built.is_file():
        raise SystemExit(f"UCM_NATIVE_PREBUILT=1 but {built} is missing: build it first (make install)")
    setup()
else:
    setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
