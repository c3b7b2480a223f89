"""The planner's probes on the rehearsal device (issue 34): the device's profile
(hardware_profiles/local-rehearsal-device.toml) puts tensor, pipeline and sharding stage 2/3
layouts into the local autotuning space, its probes run on the device (the plugin's
environment, their own run tag), and a served pipeline worker is never reused for another
micro-batch (fleet fixes it at start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BASE_PLAN, REPO, merge

from gptplan.plan import REHEARSAL_PROFILE, plan_from_dict
from runner import device
from runner.device import support as rehearsal_device

DEVICE_SPEC = REPO / "planner" / "specs" / "device_demo.toml"
CPU_SPEC = REPO / "planner" / "specs" / "cpu_demo.toml"


def layouts_of(spec_path: Path) -> set[tuple[int, int, str]]:
    """(tp, pp, sharding stage) of every candidate of the spec's space that fits."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.evaluate import evaluate_space
    from planner.spec import load_spec

    spec = load_spec(str(spec_path))
    table = evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)
    stages = ["", "stage1", "stage2", "stage3"]
    return {
        (int(table["tp"][i]), int(table["pp"][i]), stages[int(table["stage_code"][i])])
        for i in range(len(table["tp"]))
        if table["fits"][i]
    }


def test_the_devices_profile_offers_every_layout_kind_and_plain_cpu_does_not():
    device = layouts_of(DEVICE_SPEC)
    assert {(2, 1, ""), (1, 2, ""), (1, 1, "stage2"), (1, 1, "stage3")} <= device
    cpu = layouts_of(CPU_SPEC)
    assert cpu and all(tp == 1 and pp == 1 and stage in ("", "stage1") for tp, pp, stage in cpu)


def test_probing_on_the_devices_profile_without_the_device_is_one_line(monkeypatch):
    from gptplan.errors import HardwareError
    from runner import probe

    monkeypatch.setattr(
        rehearsal_device, "support", lambda: rehearsal_device.support_from({"reason": "not built"})
    )
    with pytest.raises(HardwareError) as caught:
        probe.check_local_profile(REHEARSAL_PROFILE)
    assert caught.value.key == "--local-profile" and "not built" in str(caught.value)
    probe.check_local_profile("cpu")  # plain CPU probes need no device


def device_plan(tmp_path: Path, overrides: dict):
    return plan_from_dict(
        merge(
            BASE_PLAN,
            merge(
                {
                    "job": {"output_dir": str(tmp_path / "run")},
                    "parallel": {"nproc_per_node": 2, "data_parallel_degree": 1},
                    "hardware": {"profile": REHEARSAL_PROFILE},
                },
                overrides,
            ),
        )
    )


@pytest.mark.e2e
@pytest.mark.skipif(
    not rehearsal_device.support().on_device,
    reason=f"the rehearsal device is unavailable: {rehearsal_device.support().why_not}",
)
def test_tensor_and_pipeline_probes_run_on_the_device_each_micro_batch_its_own_worker(tmp_path):
    from planner.tuning.probes import LocalProbe

    pp = {"parallel": {"pipeline_parallel_degree": 2}}
    plans = [
        device_plan(tmp_path, merge(pp, {"training": {"per_device_train_batch_size": 4}})),
        # the same pipeline layout, another micro-batch: before, the first worker took it and
        # Paddle refused ("batch_size needs to be divisible by micro_batch_size")
        device_plan(
            tmp_path,
            merge(
                pp,
                {"training": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}},
            ),
        ),
        device_plan(tmp_path, {"parallel": {"tensor_parallel_degree": 2}}),
    ]
    probe = LocalProbe(tmp_path / "probes", steps=2, warmup=1, fingerprint="fp")
    try:
        results = [probe.run(plan) for plan in plans]
    finally:
        probe.close()
    assert [r.status for r in results] == ["ok"] * 3, [r.detail for r in results]
    assert all(r.step_time_s > 0 and r.tokens_per_second > 0 for r in results)
    workers = sorted((tmp_path / "probes" / "workers").iterdir())
    assert len(workers) == 3  # one per (layout, and for pp, micro-batch x accumulation)
    tags = set()
    for worker in workers:
        env = json.loads((worker / "logs" / "backup_env.0.json").read_text())
        assert env["CUSTOM_DEVICE_ROOT"] and env[f"FLAGS_selected_{device.DEVICE_TYPE}s"]
        tags.add(env["GPTPLAN_DEVICE_RUN"])
    assert len(tags) == 3  # each worker its own communicators
