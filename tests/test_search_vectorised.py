"""The search's fast paths change no result (issue 30): step-time terms evaluated once per
distinct layout equal every row evaluated alone, the cost order equals the plain two-key sort
with ties and NaN, columns joined on first read equal the joined parts, the search prices
through gptplan.money, and planner/screen/ keeps its functions short (issue 28)."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import tomli
from conftest import merge

from gptplan import money
from gptplan.steptime import Device, Rates, distinct_rows, step_time_parts
from planner.market.hardware import load_profiles
from planner.market.offers import allowed_offers
from planner.screen import costmodel as cm
from planner.screen.decide import cheapest_first, first_ranked, pareto_front, ranked
from planner.screen.evaluate import evaluate_layouts, evaluate_space
from planner.screen.table import CandidateTable, Columns
from planner.spec import EMBEDDED_SPEC, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
BANK = tomli.loads(EMBEDDED_SPEC.read_text())
LAYOUT = (
    "nodes precision_code seq micro acc tp pp vpp dp shard_degree stage_code recompute_code "
    "sp flash rc_layers"
).split()


def small_spec():
    """The bank-FAQ spec on two cloud offers (as tests/test_planner.py's)."""
    two = merge(BANK, {"constraints": {"profiles": ["a100-80gb", "t4"]}})
    return spec_from_dict(two, file="spec.toml")


def _layouts(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    g = {
        "nodes": rng.choice([1, 2, 4], n),
        "precision_code": rng.choice([0, 1, 2], n),
        "seq": rng.choice([512, 1024], n),
        "micro": rng.choice([1, 2, 8], n),
        "acc": rng.choice([1, 4, 16, 64], n),
        "tp": rng.choice([1, 2, 4], n),
        "pp": rng.choice([1, 2, 4], n),
        "vpp": rng.choice([1, 2], n),
        "dp": rng.choice([1, 2, 8], n),
        "shard_degree": rng.choice([1, 2, 8], n),
        "stage_code": rng.choice([0, 1, 2, 3], n),
        "recompute_code": rng.choice([0, 1, 2, 3], n),
        "sp": rng.choice([0, 1], n),
        "flash": rng.choice([0, 1], n),
        "rc_layers": np.where(rng.random(n) < 0.2, rng.choice([1, 3], n), 0),
    }
    return g


def test_step_time_once_per_distinct_layout_equals_each_row_alone():
    """step_time_parts on long columns (its terms evaluated once per distinct layout, with the
    device and rates per row as the search passes them) equals the same rows one at a time."""
    shape = cm.ModelShape.from_section(small_spec().model_section())
    rng = np.random.default_rng(3)
    g = _layouts(rng, 8000)
    peak = np.array([19.5e12, 312e12, 312e12])[g["precision_code"]]
    gemm_max = np.array([0.6, 0.7, 0.72])[g["precision_code"]]
    dev = Device(peak, 108, 2.0e12, 300e9, 25e9, 8)
    rates = Rates(gemm_max, 4e-6, 0.5, 0.6)
    code = g["precision_code"]
    assert distinct_rows([g[k] for k in ("micro", "seq", "tp")], [peak]) is None  # checked
    assert distinct_rows([g[k] for k in ("micro", "seq", "tp", "precision_code")], [peak])
    fast = step_time_parts(shape, g, dev, rates)
    for i in rng.choice(len(code), 60, replace=False):
        one = {k: v[i : i + 1] for k, v in g.items()}
        one_dev = dataclasses.replace(dev, peak_flops=peak[i : i + 1])
        alone = step_time_parts(
            shape, one, one_dev, dataclasses.replace(rates, gemm_max=gemm_max[i : i + 1])
        )
        for k, v in alone.items():
            assert np.array_equal(np.broadcast_to(fast[k], code.shape)[i], v[0]), (k, i)


def test_search_rows_equal_each_layout_evaluated_alone():
    """Every column of a sample of the search's rows equals evaluate_layouts on that one
    layout (a one-row evaluation takes none of the fast paths)."""
    spec = small_spec()
    offers = allowed_offers(spec, load_profiles())[:2]
    table = evaluate_space(spec, offers, 1e9)
    m = spec.model_section()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(table), 20, replace=False):
        choice = offers[int(table["offer"][i])]
        g = {k: table[k][i : i + 1] for k in LAYOUT}
        one = evaluate_layouts(
            m, choice.profile, choice.offer, g, memory_headroom=spec.constraints.memory_headroom
        )
        for k in ("memory_gb", "fits", "step_time_s", "tokens_per_s", "mfu", "comm_s"):
            assert np.array_equal(one[k][0], table[k][i]), (k, i)


def test_cheapest_first_equals_the_two_key_sort_with_ties_and_nan():
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        cost = rng.integers(0, int(rng.integers(1, 20)), n).astype(float)
        hours = rng.integers(0, int(rng.integers(1, 4)), n).astype(float)
        if trial % 3 == 0:
            cost[rng.random(n) < 0.1] = np.nan
            hours[rng.random(n) < 0.1] = np.nan
        if trial % 5 == 0:
            cost[rng.random(n) < 0.2] = np.inf
        idx = np.flatnonzero(rng.random(n) < 0.7)
        want = idx[np.lexsort((hours[idx], cost[idx]))]
        assert np.array_equal(cheapest_first(cost, hours, idx), want), trial


def test_ranked_within_and_beyond_the_fitting_rows():
    """The order sorted once over the fitting rows serves every mask within them; a mask
    beyond them is sorted on its own; both equal the two-key sort."""
    rng = np.random.default_rng(2)
    n = 5000
    cols = {
        "cost": rng.integers(0, 50, n).astype(float),
        "hours": rng.integers(0, 5, n).astype(float),
        "fits": rng.random(n) < 0.8,
    }
    table = CandidateTable([], cols)
    for mask in (cols["fits"], cols["fits"] & (rng.random(n) < 0.5), rng.random(n) < 0.5):
        idx = np.flatnonzero(mask)
        assert np.array_equal(
            ranked(table, mask), idx[np.lexsort((cols["hours"][idx], cols["cost"][idx]))]
        )


def _double_a(columns: Columns) -> np.ndarray:
    return columns["a"] * 2


def test_columns_join_parts_when_read():
    parts = [{"a": np.arange(3), "b": np.ones(3)}, {"a": np.arange(3, 5), "b": np.zeros(2)}]
    cols = Columns([dict(p) for p in parts], {"c": _double_a})
    assert list(cols) == ["a", "b", "c"] and cols.rows == 5 and "a" in cols and "x" not in cols
    assert cols.item("b", 3) == 0.0 and cols.item("a", 4) == 4  # read without joining
    assert np.array_equal(cols["a"], np.arange(5))
    assert np.array_equal(cols["b"], [1, 1, 1, 0, 0]) and np.array_equal(cols["c"], 2 * cols["a"])
    cols["d"] = np.full(5, 7)
    del cols["b"]
    assert list(cols) == ["a", "c", "d"] and len(CandidateTable([], cols)) == 5
    with pytest.raises(KeyError):
        cols["b"]
    assert pickle.loads(pickle.dumps(cols))["d"].tolist() == [7] * 5


def test_the_search_prices_through_money(monkeypatch):
    """Issue 28: money = price x nodes x time comes from gptplan.money, not a copy."""
    spec = small_spec()
    offers = allowed_offers(spec, load_profiles())[:1]
    plain = evaluate_space(spec, offers, 1e9)["cost"]
    real = money.cost_of_hours
    monkeypatch.setattr(money, "cost_of_hours", lambda **kw: 2.0 * real(**kw))
    assert np.array_equal(evaluate_space(spec, offers, 1e9)["cost"], 2.0 * plain)


def test_a_row_has_exactly_the_keys_of_the_candidate_row_type():
    """Issue 38: functions that take a chosen candidate read a CandidateRow (a TypedDict the
    type checker holds them to); a column added to or dropped from the table without the type
    fails here."""
    from planner.screen.table import CandidateRow

    spec = small_spec()
    table = evaluate_space(spec, allowed_offers(spec, load_profiles())[:1], 1e9)
    row = table.row(0)
    assert set(row) == set(CandidateRow.__required_keys__)
    assert set(CandidateRow.__optional_keys__) == {  # what a measured row adds
        "step_time_interval_s",
        "step_time_spread",
        "interval_source",
    }
    assert isinstance(row["offer_choice"].node_price(spot=bool(row["spot"])), float)


SEARCH_MODULES = [
    "planner/market/offers.py",
    *(f"planner/screen/{m}.py" for m in ("space", "table", "evaluate", "pricing", "memory")),
    "planner/screen/decide.py",
]


@pytest.mark.parametrize("module", SEARCH_MODULES)
def test_search_functions_are_short(module):
    """Issue 28: no function of the search (planner/search.py until issue 38 split it into
    these modules) is longer than 60 lines."""
    tree = ast.parse((ROOT / module).read_text())
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    }
    assert not long, long


def test_first_ranked_and_pareto_front_equal_the_full_sort():
    """decide's cheapest rows (first_ranked) and the Pareto front screened before sorting
    equal those of the full two-key sort, with ties, infinities and NaN."""
    rng = np.random.default_rng(4)
    for trial in range(12):
        n = int(rng.integers(3000, 20000))
        cols = {
            "cost": rng.integers(0, int(rng.integers(5, 5000)), n).astype(float),
            "hours": rng.integers(0, int(rng.integers(2, 300)), n).astype(float),
            "fits": rng.random(n) < 0.9,
        }
        cols["hours"] += 1000.0 / (1.0 + cols["cost"])  # a front: the cheap are slow
        if trial % 3 == 0:
            cols["cost"][rng.random(n) < 0.01] = np.nan
            cols["hours"][rng.random(n) < 0.01] = np.inf
        if trial % 4 == 1:
            cols["hours"][rng.random(n) < 0.001] = np.nan
        table = CandidateTable([], cols)
        for mask in (cols["fits"], rng.random(n) < 0.3, np.zeros(n, bool)):
            order = ranked(table, mask)
            assert first_ranked(table, mask) == (int(order[0]) if len(order) else None)
            h = cols["hours"][order]
            plain = order[h < np.concatenate([[np.inf], np.minimum.accumulate(h)[:-1]])]
            assert np.array_equal(pareto_front(table, mask), plain), trial
