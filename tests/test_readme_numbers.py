"""The plan numbers README.md and docs/ state are what the shipped plans say
(bench/readme_numbers.py): CI fails when a plan is re-derived without
`python bench/readme_numbers.py --write`, or a block is edited by hand."""

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


def test_stated_plan_numbers_match_the_shipped_plans():
    rn = _script()
    problems = rn.check_files(rn.blocks())
    assert not problems, "\n".join(problems) + "\nrun: python bench/readme_numbers.py --write"


def test_the_check_catches_a_drifted_number():
    rn = _script()
    want = rn.blocks()
    text = rn.rewrite((REPO / "docs" / "models.md").read_text(encoding="utf-8"), want)
    assert rn.check(text, want) == []
    drifted = text.replace(want["llama_zh"], want["llama_zh"].replace(" CNY", "0 CNY", 1))
    assert [p.split(":")[0] for p in rn.check(drifted, want)] == ["llama_zh"]


def test_the_check_catches_a_block_no_file_holds(tmp_path):
    rn = _script()
    want = rn.blocks()
    page = tmp_path / "page.md"
    page.write_text(rn.rewrite((REPO / "README.md").read_text(encoding="utf-8"), want))
    problems = rn.check_files(want, [page])
    assert problems and all(p.endswith("no file holds this block") for p in problems)
    assert {p.split(":")[0] for p in problems} == set(want) - {"bank_faq_table", "demo_time"}
