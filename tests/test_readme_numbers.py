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


def test_write_refreshes_the_worked_example_from_the_output():
    """`--write` replaces the README's console block of `planner optimize --budget 12000` by
    the picked lines of what the command printed (here a stand-in output)."""
    rn = _script()
    printed = "\n".join(
        [
            "reusing tokenizer ...",
            "corpus tokens: 9.99B (new)",
            "padding ...",
            "Top 10 distinct decisions (new)",
            "  feasible of 5",
            "    offer  hours",
            "--  -----  -----",
            "*   a      1",
            "    b      2",
            "    c      3",
            "    d      4",
            "model: x",
            "chosen: a (new)",
            "  none: 1 CNY",
            "        risk: none",
            "          more",
            "        memory ...",
            "        sensitivity: price (new)",
            "          more",
            "planned in 0.5 s",
            "wrote plans/bank_faq.toml",
        ]
    )
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    new = rn.rewrite_example(readme, printed)
    block = new.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0] == "$ planner optimize --budget 12000"
    assert block[1:] == [
        "...",
        "corpus tokens: 9.99B (new)",
        "...",
        *printed.splitlines()[3:10],
        "...",
        *printed.splitlines()[12:16],
        "...",
        "        sensitivity: price (new)",
        "...",
        "wrote plans/bank_faq.toml",
    ]
    assert new.replace("\n".join(block), "") == readme.replace(
        readme.split("```console\n", 1)[1].split("```", 1)[0].rstrip("\n"), ""
    )
