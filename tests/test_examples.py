"""The MinT-style SFT-then-RL script runs unchanged against mint on the embedded model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]


def test_sft_then_rl_script_runs_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sft_then_rl.py"), "--sft-steps", "1", "--sft-batch", "2",
         "--rl-steps", "2", "--groups-per-batch", "2", "--group-size", "2", "--eval-size", "4", "--eval-every", "1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MINTFLOW_CHECKPOINTS": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out greedy accuracy of the base model" in out.stdout
    assert "RL step 2/2" in out.stdout and "SFT then GRPO" in out.stdout
    assert (next(tmp_path.iterdir()) / "sft" / "manifest.json").is_file()
