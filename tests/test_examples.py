"""The examples run as a user runs them (the README's first command ends with the quickstart)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.parametrize("script", ["quickstart.py", "retnet.py", "mlstm.py", "hgrn2.py", "power_retention.py"])
def test_example_runs(script):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
