"""examples/hf_grpo_step.py runs a complete GRPO step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.hf.models import transformers  # noqa: F401  (skips without transformers)


def test_hf_grpo_step_example_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "examples" / "hf_grpo_step.py"
    spec = importlib.util.spec_from_file_location("hf_grpo_step", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "one GRPO step" in out and "nan" not in out.lower()
