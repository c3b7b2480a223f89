"""README's plan numbers are what the shipped plans say (bench/readme_numbers.py): CI fails when
a plan is re-derived without `python bench/readme_numbers.py --write`, or README is edited by
hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "readme_numbers", REPO / "bench" / "readme_numbers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_plan_numbers_match_the_shipped_plans():
    rn = _script()
    problems = rn.check(rn.README.read_text(encoding="utf-8"), rn.blocks())
    assert not problems, "\n".join(problems) + "\nrun: python bench/readme_numbers.py --write"


def test_the_check_catches_a_drifted_number():
    rn = _script()
    want = rn.blocks()
    text = rn.rewrite(rn.README.read_text(encoding="utf-8"), want)
    assert rn.check(text, want) == []
    drifted = text.replace(want["llama_zh"], want["llama_zh"].replace(" CNY", "0 CNY", 1))
    assert [p.split(":")[0] for p in rn.check(drifted, want)] == ["llama_zh"]
