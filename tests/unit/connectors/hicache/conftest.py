"""SGLang's real pools and storage factory on CPU, in SGLang's venv
(.venv-sglang; `make test-sglang`). Elsewhere these tests skip. SGLang's
imports need the import-only stand-ins of tests/sglang_cpu (never called);
no SGLang code is patched here."""
import importlib.util
import pathlib
import sys

SHIM_DIR = pathlib.Path(__file__).resolve().parents[3] / "sglang_cpu"

if importlib.util.find_spec("sglang") is not None:
    sys.path.insert(0, str(SHIM_DIR))
    import stand_ins

    stand_ins.install()
