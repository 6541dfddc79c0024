"""The GPU tools' references into the test suite stay valid: tools/gpu_sanitize.sh names test
functions, and one stale name makes pytest collect nothing, so the sanitizer would check nothing."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cpu


def test_every_test_that_gpu_sanitize_runs_exists():
    script = (REPO / "tools" / "gpu_sanitize.sh").read_text()
    ids = re.findall(r"tests/test_\w+\.py::\w+(?:\[[^\]]*\])?", script)
    assert len(ids) >= 10, ids
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=REPO, capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    listed = set(collected.stdout.split())
    missing = [test_id for test_id in ids
               if test_id not in listed and not any(item.startswith(test_id + "[") for item in listed)]
    assert not missing, missing
