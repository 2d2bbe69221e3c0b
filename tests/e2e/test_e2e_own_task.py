"""docs/guide/your-task.md: the worked example (rows in a JSONL file, a reward function in the user's own
module, the command) runs as the guide writes it, with fewer steps."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- tests/e2e/test_e2e_own_task.py runs this block"
LAST = "  log.run_dir=runs/my-task\n"


def _guide_block() -> str:
    text = (REPO / "docs" / "guide" / "your-task.md").read_text()
    assert text.count(MARKER) == 1, "the guide's own-task example lost its marker"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S).group(1)
    assert block.count(LAST) == 1, "the example's command no longer ends with its run directory"
    return block


def test_the_guides_own_task_example_runs_as_written(tmp_path):
    (tmp_path / "launch").symlink_to(REPO / "launch")  # the example runs from the repository root
    block = _guide_block().replace(LAST, "  log.run_dir=runs/my-task train.steps=2 train.eval_every=2 "
                                          "log.progress=false log.report=false\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    run = tmp_path / "runs" / "my-task"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/failures"] == 0.0 and 0.0 <= r["reward/mean"] <= 1.0 for r in rows)  # the user's function ran
    assert "eval/success_rate" in rows[-1]
    config = (run / "config.yaml").read_text()
    assert "my_rewards:exact_match" in config and "my_task/rows.jsonl" in config
    assert len((tmp_path / "my_task" / "rows.jsonl").read_text().splitlines()) == 10
