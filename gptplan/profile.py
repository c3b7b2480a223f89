"""Reading a hardware profile's performance data (hardware_profiles/<name>.toml) in the runner.

The planner owns profiles and offers (planner.hardware); the runner needs a profile's numbers
for one thing: modelling a local rehearsal (`runner execute --local`) on this machine's profile
(peak FLOP/s, efficiency curve, memory overhead, links). The `Efficiency` table and the way a
machine's calibration overrides it are defined here, once, and planner.hardware uses them, so
the planner and the runner read the same file the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gptplan import userdata
from gptplan.errors import UserError
from gptplan.tomlconf import from_table, read_toml, setting

# The shipped profiles: read-only package data (in a checkout or an editable install the
# project's own folder; in an installed wheel site-packages/hardware_profiles).
PROFILE_DIR = Path(__file__).resolve().parents[1] / "hardware_profiles"
# Machine-specific calibrations live in the user data directory (gptplan.userdata), never in
# the package; GPTPLAN_CALIBRATION_DIR moves them alone (shared setups).
LOCAL_CALIBRATION_ENV = userdata.CALIBRATION_ENV
CALIBRATION_TABLES = ("efficiency", "efficiency_fp32", "efficiency_fp16", "efficiency_bf16")


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
        "the published runs (planner.coverage), added in quadrature to the interval's log "
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
class PerformanceData:
    """What the runner models a step with: one profile's peaks, links and efficiency."""

    name: str
    memory_gb: float
    memory_bandwidth_gbytes_per_s: float
    intra_node_gbytes_per_s: float
    sm_count: int = 0
    peak_tflops: dict = field(default_factory=dict)
    efficiency: Efficiency = field(default_factory=Efficiency)
    efficiency_by_precision: dict = field(default_factory=dict)
    file: str = ""

    def efficiency_for(self, precision: str) -> Efficiency:
        return self.efficiency_by_precision.get(precision, self.efficiency)

    def peak_for(self, precision: str) -> float:
        """Same rule as planner.hardware.Profile.peak_for: fp32 matmuls use TF32 if it exists."""
        if precision == "fp32":
            return self.peak_tflops.get("tf32") or self.peak_tflops.get("fp32", 0.0)
        return self.peak_tflops.get(precision, 0.0)


def read_performance(name: str, directory: Path = PROFILE_DIR) -> PerformanceData:
    """The performance numbers of profile `name`, with this machine's calibration applied."""
    if not name or "/" in name or name.startswith("."):
        raise ProfileError(f"{name!r} is not a profile name", key="hardware.profile")
    path = Path(directory) / f"{name}.toml"
    data = read_toml(path, ProfileError)
    eff = from_table(
        Efficiency,
        data.get("efficiency", {}),
        file=str(path),
        section="efficiency",
        error=ProfileError,
    )
    by_precision: dict = {}
    calib = calibration_dir() / f"{name}.toml"
    if calib.is_file():
        base, by_precision = calibration_tables(calib)
        eff = base or eff
    peaks = {
        k: float(v)
        for k, v in data.get("peak_tflops", {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return PerformanceData(
        name=name,
        memory_gb=float(data.get("memory_gb", 0.0)),
        memory_bandwidth_gbytes_per_s=float(data.get("memory_bandwidth_gbytes_per_s", 0.0)),
        intra_node_gbytes_per_s=float(data.get("intra_node_gbytes_per_s", 0.0)),
        sm_count=int(data.get("sm_count", 0)),
        peak_tflops=peaks,
        efficiency=eff,
        efficiency_by_precision=by_precision,
        file=str(path),
    )
