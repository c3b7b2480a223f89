"""Cost-model formulas against hand-computed values from the cited papers, and monotonicity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gptplan import steptime as st
from planner import costmodel as cm
from gptplan.modelfacts import MODEL_SIZES
from gptplan.plan import ModelSection

BASE = ModelSection(**vars(MODEL_SIZES["gpt-base-110m"]))
SHAPE = cm.ModelShape.from_section(BASE)


@pytest.mark.parametrize("mixed,stage,degree,expected", [
    (True, 0, 8, 16.0),           # ZeRO: 2 + 2 + 12
    (True, 1, 8, 4 + 12 / 8),     # stage 1: 4 + 12/d
    (True, 2, 8, 2 + 14 / 8),     # stage 2: 2 + 14/d
    (True, 3, 8, 16 / 8),         # stage 3: 16/d
    (False, 0, 4, 16.0),          # fp32: 4 + 4 + 8
    (False, 1, 4, 8 + 8 / 4),
])
def test_zero_bytes_per_param(mixed, stage, degree, expected):
    assert cm.model_state_bytes_per_param(mixed, stage, degree) == pytest.approx(expected)


def test_korthikanti_activation_table():
    s, b, h, a = 1024, 1, 768, 12
    sbh = s * b * h
    args = dict(seq_len=s, micro_batch=b, act_bytes=2.0)
    none = cm.activation_bytes_per_layer(SHAPE, tp=1, seq_parallel=False, recompute_code=0, **args)
    assert none == pytest.approx(sbh * (34 + 5 * a * s / h))          # 114 sbh
    tp2 = cm.activation_bytes_per_layer(SHAPE, tp=2, seq_parallel=False, recompute_code=0, **args)
    assert tp2 == pytest.approx(sbh * (10 + 24 / 2 + 5 * a * s / (h * 2)))
    tpsp = cm.activation_bytes_per_layer(SHAPE, tp=2, seq_parallel=True, recompute_code=0, **args)
    assert tpsp == pytest.approx(sbh * (34 + 5 * a * s / h) / 2)
    selective = cm.activation_bytes_per_layer(SHAPE, tp=1, seq_parallel=False,
                                              recompute_code=1, **args)
    assert selective == pytest.approx(sbh * 34)
    full = cm.activation_bytes_per_layer(SHAPE, tp=1, seq_parallel=False, recompute_code=3,
                                         **args)
    assert full == pytest.approx(2 * sbh)


def test_recompute_flops_match_narayanan_ratio():
    """[N21]: full recompute costs about 4/3 of model FLOPs (exactly 4/3 of the 6N part)."""
    extra = st.recompute_extra_flops_per_token(SHAPE, 1024, 3)
    assert extra == pytest.approx(2 * SHAPE.params_body + 4 * 12 * 768 * 1024)
    model = cm.model_flops_per_token(BASE, 1024)
    assert 1.2 < (model + extra) / model < 4 / 3 + 0.01


def test_young_daly_and_useful_fraction():
    tau = cm.young_daly_interval_hours(0.1, 0.05)
    assert tau == pytest.approx(2.0)          # sqrt(2 * 0.1 / 0.05)
    u = cm.useful_fraction(0.1, tau, 0.05, 1 / 6)
    assert u == pytest.approx(1 - 0.1 / 2 - 0.05 * (1 + 1 / 6))
    assert cm.young_daly_interval_hours(0.1, 0.0) == np.inf
    assert cm.useful_fraction(0.1, np.inf, 0.0, 0.5) == 1.0


def test_bubble_and_ring():
    assert st.pipeline_bubble_factor(4, 8) == pytest.approx(11 / 8)
    assert st.pipeline_bubble_factor(1, 8) == 1.0
    assert st.ring_allreduce_seconds(1e9, 4, 1e9) == pytest.approx(1.5)
    assert st.ring_allreduce_seconds(1e9, 1, 1e9) == 0.0


def test_efficiency_grows_with_work_and_saturates():
    small = st.curve_efficiency(micro_batch=1, seq_len=128, hidden_per_tp=256, eff_max=0.5,
                                  half_tokens=2048, half_hidden=384)
    big = st.curve_efficiency(micro_batch=64, seq_len=2048, hidden_per_tp=8192, eff_max=0.5,
                                half_tokens=2048, half_hidden=384)
    assert small < 0.05 < 0.45 < big <= 0.5


def memory(**kw):
    args = dict(seq_len=1024, micro_batch=8, accumulation=4, tp=1, pp=1, stage_code=0,
                shard_degree=8, recompute_code=0, seq_parallel=False, mixed_precision=True,
                overhead_gb=1.0, fragmentation=1.1) | kw
    return float(cm.memory_per_device_bytes(SHAPE, **args))


GRID = list(itertools.product([1, 2, 4], [1, 2], [0, 1, 2, 3], [0, 1, 2, 3], [False, True],
                              [1, 8, 32]))


@pytest.mark.parametrize("tp,pp,stage,recompute,mixed,micro", GRID[::7])
def test_memory_is_monotone(tp, pp, stage, recompute, mixed, micro):
    """More sharding, more recompute or more tensor parallel never increases memory."""
    base = dict(tp=tp, pp=pp, stage_code=stage, recompute_code=recompute,
                mixed_precision=mixed, micro_batch=micro)
    here = memory(**base)
    if stage < 3:
        assert memory(**(base | {"stage_code": stage + 1})) <= here
    if recompute < 3:
        assert memory(**(base | {"recompute_code": recompute + 1})) <= here
    assert memory(**(base | {"tp": tp * 2})) <= here
    if tp > 1:
        assert memory(**(base | {"seq_parallel": True})) <= here
    assert memory(**(base | {"micro_batch": micro * 2})) >= here
