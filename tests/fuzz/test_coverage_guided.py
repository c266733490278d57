"""Coverage-guided fuzzing (atheris / libFuzzer) of the protocol decoder, the
NVMe footer parser and the config loader, bounded for CI: each target runs
a fixed number of inputs in a subprocess (libFuzzer owns its process) and
must finish without a crash. UCMFUZZ_RUNS multiplies the counts by hand."""
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

TARGETS = Path(__file__).resolve().with_name("atheris_targets.py")
RUNS = {"protocol": 30000, "nvme": 30000, "config": 1500}


@pytest.mark.parametrize("target", sorted(RUNS))
def test_target_survives_its_inputs(target, tmp_path):
    runs = RUNS[target] * int(os.environ.get("UCMFUZZ_RUNS", "1"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}  # no config overrides
    # libFuzzer checks ru_maxrss, which Linux carries over a fork + exec from this process: after the
    # e2e tests loaded models here it starts above libFuzzer's default 2 GiB limit. Keep 2 GiB above it.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    proc = subprocess.run([sys.executable, str(TARGETS), target, f"-runs={runs}", "-seed=1",
                           f"-rss_limit_mb={inherited_mb + 2048}", f"-artifact_prefix={tmp_path}/"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    done = re.search(r"Done (\d+) runs", out)
    assert done and int(done.group(1)) == runs, out[-2000:]
    assert not list(tmp_path.glob("crash-*"))
