"""Reading a hardware profile (hardware_profiles/<name>.toml): the one strict reader.

A profile is one accelerator: specs, peak TFLOPS per [peak_tflops] key, the efficiency tables
and the priced [[offers]]. This module reads the device part (DeviceProfile, peak_for and
efficiency_for, a machine's calibration) for both tools: the runner models a local rehearsal
(`runner execute --local`) with it, and planner.market.hardware builds its Profile (the device plus
its checked offers) from `read_profile_file`, so the planner and the runner read the same file
the same way, and bad input is one line naming the file, the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gptplan import precision as precisions
from gptplan import userdata
from gptplan.errors import UserError
from gptplan.plan import Device, plain_cpu
from gptplan.tomlconf import DEFAULT_MAX, from_table, read_toml, setting, table_array

# The shipped profiles: read-only package data (in a checkout or an editable install the
# project's own folder; in an installed wheel site-packages/hardware_profiles).
PROFILE_DIR = Path(__file__).resolve().parents[1] / "hardware_profiles"
# Machine-specific calibrations live in the user data directory (gptplan.userdata), never in
# the package; GPTPLAN_CALIBRATION_DIR moves them alone (shared setups).
LOCAL_CALIBRATION_ENV = userdata.CALIBRATION_ENV
CALIBRATION_TABLES = ("efficiency", *(f"efficiency_{p}" for p in precisions.PLANNABLE))
# Keys of a profile's [peak_tflops]: the peak keys of gptplan.precision's rows. fp8 serves only
# the fit to published FP8 runs (planner.screen.published): `precisions`, what a plan may choose,
# never lists it.
PEAK_KEYS = tuple(dict.fromkeys(k for r in precisions.ROWS for k in r.gemm_peak + r.other_peak))


class ProfileError(UserError):
    """A hardware profile or price list is malformed."""


def calibration_dir() -> Path:
    """$GPTPLAN_CALIBRATION_DIR, else the user data directory's calibration/."""
    return userdata.calibration_dir()


# Models this large get their own interval (their published runs scatter more).
LARGE_MODEL_PARAMS = 15e9


@dataclass(frozen=True)
class Efficiency:
    max: float = setting(
        0.5,
        "Attainable fraction of peak FLOP/s of a large, well-shaped GEMM "
        "(devices with sm_count; others: the whole-layer curve's "
        "maximum).",
        min=0,
        max=1,
    )
    kernel_overhead_us: float = setting(
        5.0,
        "Per-kernel overhead (launch, tail, "
        "synchronisation), microseconds; devices with "
        "sm_count only.",
        min=0,
    )
    half_tokens: float = setting(
        2048.0,
        "Devices without sm_count (the curve): tokens per micro-batch at which efficiency halves.",
        min=0,
    )
    half_hidden: float = setting(
        384.0,
        "Devices without sm_count (the curve): hidden size per "
        "tensor-parallel rank at which efficiency halves.",
        min=0,
    )
    rolloff_tokens: float = setting(
        0.0,
        "Tokens per micro-batch beyond which efficiency falls "
        "again (the working set outgrows the caches, seen on "
        "CPUs); 0 = never.",
        min=0,
    )
    attention_relative: float = setting(
        1.0,
        "Achieved FLOP/s of the attention score/value "
        "kernels relative to large GEMMs (fitted from "
        "runs at several seq_len).",
        min=0,
        min_exclusive=True,
    )
    comm_overlap: float = setting(
        0.5, "Share of data-parallel gradient sync hidden behind backward compute.", min=0, max=1
    )
    memory_overhead_gb: float = setting(
        1.5,
        "Framework memory per device beyond the model "
        "(CUDA context, workspaces; Python+Paddle on CPU).",
        min=0,
    )
    fragmentation: float = setting(1.1, "Allocator margin on activations and logits.", min=1)
    source: str = setting("uncalibrated prior", "Where these numbers come from.")
    calibrated_on: str = setting("", "Machine fingerprint of a calibration (if any).")
    calibrated_at: str = setting("", "Date of the calibration (if any).")
    fit_error: float = setting(0.0, "Median absolute relative error of the fit.", min=0)
    throughput_p10: float = setting(
        0.6,
        "10th percentile of measured/modelled tokens/s (leave-one-out residuals of the "
        "fit): the low end of the 80% interval on modelled throughput. The default, for "
        "hardware with no fit, is wider than the shared prior's spread on published "
        "A100/H100 runs (p10 0.98, p90 1.67).",
        min=0,
        min_exclusive=True,
    )
    throughput_p90: float = setting(
        1.7,
        "90th percentile of measured/modelled tokens/s: the high end of the 80% interval.",
        min=0,
        min_exclusive=True,
    )
    throughput_p10_large: float = setting(
        0.0,
        "Like throughput_p10, for models of at least LARGE_MODEL_PARAMS (15e9) parameters, "
        "whose published runs scatter more: the interval widened to their own spread "
        "(0 = use throughput_p10).",
        min=0,
    )
    throughput_p90_large: float = setting(
        0.0, "Like throughput_p90 for large models (0 = use throughput_p90).", min=0
    )
    fit_rows: int = setting(0, "Published runs the fit used (0 = not fitted).", min=0)
    extrapolation_log_error: float = setting(
        0.4,
        "Extra 80% error, in |log(measured/modelled)|, per axis on which a query lies outside "
        "the published runs (planner.screen.coverage), added in quadrature to the interval's log "
        "half-widths: leave-one-regime-out against leave-one-row-out error "
        "(bench/published/fit_priors.py; 0.4, about x1.5, where not measured).",
        min=0,
    )
    interval_basis: str = setting(
        "",
        "What the 80% interval rests on, in a few words (e.g. "
        "'leave-one-source-out over 7 sources, 233 runs').",
    )

    def interval_ratios(self, params_total: float) -> tuple[float, float]:
        """(p10, p90) of measured/modelled tokens/s for a model of this size."""
        if (
            params_total >= LARGE_MODEL_PARAMS
            and self.throughput_p10_large
            and self.throughput_p90_large
        ):
            return self.throughput_p10_large, self.throughput_p90_large
        return self.throughput_p10, self.throughput_p90


def calibration_tables(path: Path) -> tuple[Efficiency | None, dict[str, Efficiency]]:
    """A calibration file: its [efficiency] (None if absent) and [efficiency_<precision>]."""
    data = read_toml(path, ProfileError)
    for key in data:
        if key not in CALIBRATION_TABLES:
            raise ProfileError(
                f"unknown table; allowed: {', '.join(CALIBRATION_TABLES)}", file=str(path), key=key
            )
    base = (
        from_table(
            Efficiency, data["efficiency"], file=str(path), section="efficiency", error=ProfileError
        )
        if "efficiency" in data
        else None
    )
    by_precision = {
        key.split("_", 1)[1]: from_table(
            Efficiency, data[key], file=str(path), section=key, error=ProfileError
        )
        for key in CALIBRATION_TABLES[1:]
        if key in data
    }
    return base, by_precision


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator as its hardware profile describes it (hardware_profiles/<name>.toml):
    specs, peak TFLOPS per [peak_tflops] key and the efficiency tables. The planner's Profile
    adds the priced [[offers]]; the runner models a local rehearsal with this alone."""

    name: str = setting("", "Profile name (file stem).")
    vendor: str = setting("", "Vendor.")
    device: Device = setting("gpu", "Device type.")
    memory_gb: float = setting(0.0, "Memory per device, GB.", min=0)
    memory_bandwidth_gbytes_per_s: float = setting(0.0, "Memory bandwidth, GB/s.", min=0)
    intra_node_gbytes_per_s: float = setting(
        0.0, "Device-to-device bandwidth in a node, GB/s.", min=0
    )
    intra_node_link: str = setting("", "Link type.")
    tdp_w: float = setting(0.0, "Board power, W.", min=0)
    sm_count: int = setting(
        0,
        "Streaming multiprocessors (NVIDIA datasheets/whitepapers): the "
        "GEMM tile/wave model; 0 = none (CPUs, NPUs: the calibrated "
        "whole-layer curve).",
        min=0,
    )
    verified: bool = setting(True, "False when figures are unverified leads.")
    flash_attention: bool = setting(
        False,
        "Paddle's flash attention kernels run here (CUDA "
        "compute capability >= 8.0: Ampere and newer).",
    )
    source: str = setting("", "Where the specs come from.")
    peak_tflops: dict[str, float] = field(default_factory=dict)  # [peak_tflops] key -> TFLOPS
    efficiency: Efficiency = field(default_factory=Efficiency)
    efficiency_by_precision: dict[str, Efficiency] = field(default_factory=dict)

    @property
    def plain_cpu(self) -> bool:
        """Paddle's CPU build as it is (gptplan.plan.plain_cpu): data parallel and sharding
        stage 1 only; the rehearsal device's profile runs every layout kind."""
        return plain_cpu(self.device, self.name)

    def efficiency_for(self, precision: str) -> Efficiency:
        """Calibrated per precision where a calibration exists, else the profile default."""
        return self.efficiency_by_precision.get(precision, self.efficiency)

    def peak_for(self, precision: str) -> float:
        """Dense peak TFLOPS of `precision`'s linear-layer GEMMs (gptplan.precision's
        gemm_peak keys: fp32 matmuls use TF32 where it exists, Paddle enabling TF32 for cuBLAS
        by default; fp8 its own peak); 0 = none."""
        return precisions.peak_tflops(self.peak_tflops, precisions.row(precision).gemm_peak)

    def non_gemm_peak_for(self, precision: str) -> float:
        """Dense peak TFLOPS of the rest of `precision`'s work (attention, LM head): the same
        as peak_for except where the linear GEMMs run narrower (fp8: bf16)."""
        return precisions.peak_tflops(self.peak_tflops, precisions.row(precision).other_peak)

    @property
    def precisions(self) -> list[str]:
        """What a plan may choose on this device: the plannable precisions it has a peak for."""
        return [p for p in precisions.PLANNABLE if self.peak_for(p)]


def read_profile_file(path: Path) -> tuple[DeviceProfile, list]:
    """The one strict reader of a hardware profile file: the device (every key checked,
    [peak_tflops] keys in PEAK_KEYS with positive numbers, `name` equal to the file name) and
    its [[offers]] tables as read (the planner checks and prices them, planner.market.hardware)."""
    data = dict(read_toml(path, ProfileError))
    file = str(path)
    peaks = data.pop("peak_tflops", {})
    eff = from_table(
        Efficiency, data.pop("efficiency", {}), file=file, section="efficiency", error=ProfileError
    )
    offers = table_array(data, "offers", file=file, error=ProfileError)
    data.pop("offers", None)
    if not isinstance(peaks, dict):
        raise ProfileError("must be a table ([peak_tflops])", file=file, key="peak_tflops")
    for key, value in peaks.items():
        if (
            key not in PEAK_KEYS
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= DEFAULT_MAX
        ):
            raise ProfileError(
                f"{value!r}: allowed keys {', '.join(PEAK_KEYS)} with numbers > 0 and "
                f"<= {DEFAULT_MAX:g}",
                file=file,
                key=f"peak_tflops.{key}",
            )
    base = from_table(DeviceProfile, data, file=file, section="", error=ProfileError)
    if base.name != path.stem:
        raise ProfileError(
            f"{base.name!r} must equal the file name {path.stem!r}", file=file, key="name"
        )
    device = dataclasses.replace(
        base, peak_tflops={k: float(v) for k, v in peaks.items()}, efficiency=eff
    )
    return device, offers


P = TypeVar("P", bound=DeviceProfile)


def apply_calibration(profile: P, path: Path) -> P:
    """Merge a calibration file: [efficiency] and optional [efficiency_<precision>] tables."""
    base, by_precision = calibration_tables(path)
    return dataclasses.replace(
        profile, efficiency=base or profile.efficiency, efficiency_by_precision=by_precision
    )


def read_performance(name: str, directory: Path = PROFILE_DIR) -> DeviceProfile:
    """Profile `name` (read strictly, read_profile_file), with this machine's calibration."""
    if not name or "/" in name or name.startswith("."):
        raise ProfileError(f"{name!r} is not a profile name", key="hardware.profile")
    profile, _ = read_profile_file(Path(directory) / f"{name}.toml")
    calib = calibration_dir() / f"{name}.toml"
    return apply_calibration(profile, calib) if calib.is_file() else profile
