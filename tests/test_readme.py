"""The README's usage example runs as written."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.model


def test_readme_usage_example_runs(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "ServiceClient" in block)
    monkeypatch.setenv("MINTFLOW_CHECKPOINTS", str(tmp_path))
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert Path(namespace["path"]).is_dir() and len(namespace["datums"]) == 4
