"""The number formats: one row per precision, the one place each precision's facts live.

A row says what the precision means to every part of the project: bytes per element (memory,
step time), the Paddle dtype the runner hands to paddle.amp and fleet, which AMP levels apply,
master weights and loss scaling, which [peak_tflops] keys of a hardware profile its GEMMs run
at, and whether a plan may choose it. Vectorised tables (the planner's candidate columns, the
published-run fit) carry a precision as its row's `code`: a stable number written in the row,
never a position in a tuple, so a new row never shifts the codes of the others.

Sources: [AMP] Paddle 3.3.1 `paddle.amp.auto_cast`/`decorate` (levels O1/O2, dtype float16 or
bfloat16; O2 keeps fp32 master weights through the optimizer's multi_precision) and
`paddle.amp.GradScaler` (dynamic loss scaling, needed for fp16's narrow exponent, not for bf16);
[TE] NVIDIA Transformer Engine's FP8 "hybrid" recipe (linear layers' GEMMs in FP8 with 1-byte
operands, everything else in bf16), as in the published MLPerf runs planner.screen.published fits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

AmpLevel = Literal["O1", "O2"]
PaddleDtype = Literal["float32", "float16", "bfloat16"]
FP32_BYTES = 4.0  # an fp32 element: master weights, AdamW moments, fp32 logits and softmax


@dataclass(frozen=True)
class PrecisionRow:
    name: str  # as plans, specs and published runs spell it
    code: int  # stable code in vectorised tables; never reused, never renumbered
    bytes_per_element: float  # weights, gradients and activations in the compute dtype
    gemm_bytes_per_element: float  # operands of the linear layers' GEMMs
    paddle_dtype: PaddleDtype  # paddle.amp / fleet amp dtype ("float32": no AMP)
    amp_levels: tuple[AmpLevel, ...]  # training.fp16_opt_level values applied; () = no AMP
    master_weights: bool  # at O2 the optimizer keeps fp32 master weights (multi_precision)
    loss_scaling: bool  # dynamic loss scaling (paddle.amp.GradScaler)
    gemm_peak: tuple[str, ...]  # [peak_tflops] keys of the linear GEMMs, first present wins
    other_peak: tuple[str, ...]  # [peak_tflops] keys of the rest (attention, LM head)
    flash_attention: bool  # Paddle's flash attention kernels run in this dtype
    plannable: bool  # a plan may choose it (the runner can train it)
    why_not: str = ""  # why it is not plannable

    @property
    def mixed(self) -> bool:
        """Trained under paddle.amp (a 16-bit compute dtype next to fp32 state)."""
        return bool(self.amp_levels)

    @property
    def narrow_gemms(self) -> bool:
        """The linear GEMMs run in a narrower type than the rest [TE]: their inputs are cast
        (with a transposed copy for the backward pass) and they run at their own peak."""
        return self.gemm_bytes_per_element < self.bytes_per_element

    @property
    def optimizer_bytes_per_param(self) -> float:
        """AdamW's two fp32 moments, plus the fp32 master weight where one is kept."""
        return FP32_BYTES * (2 + self.master_weights)

    @property
    def logit_bytes(self) -> float:
        """Bytes per logit alive at the loss kernel: the logits in the compute dtype, their
        fp32 copy and the fp32 softmax (gptplan.memory.memory_terms)."""
        return self.bytes_per_element + 2 * FP32_BYTES


FP32 = PrecisionRow(
    "fp32",
    code=0,
    bytes_per_element=4.0,
    gemm_bytes_per_element=4.0,
    paddle_dtype="float32",
    amp_levels=(),
    master_weights=False,
    loss_scaling=False,
    # Paddle enables TF32 for cuBLAS by default: fp32 matmuls run at the TF32 peak where the
    # device has one
    gemm_peak=("tf32", "fp32"),
    other_peak=("tf32", "fp32"),
    flash_attention=False,
    plannable=True,
)
FP16 = PrecisionRow(
    "fp16",
    code=1,
    bytes_per_element=2.0,
    gemm_bytes_per_element=2.0,
    paddle_dtype="float16",
    amp_levels=("O1", "O2"),
    master_weights=True,
    loss_scaling=True,
    gemm_peak=("fp16",),
    other_peak=("fp16",),
    flash_attention=True,
    plannable=True,
)
BF16 = PrecisionRow(
    "bf16",
    code=2,
    bytes_per_element=2.0,
    gemm_bytes_per_element=2.0,
    paddle_dtype="bfloat16",
    amp_levels=("O1", "O2"),
    master_weights=True,
    loss_scaling=False,
    gemm_peak=("bf16",),
    other_peak=("bf16",),
    flash_attention=True,
    plannable=True,
)
FP8 = PrecisionRow(
    "fp8",
    code=3,
    bytes_per_element=2.0,
    gemm_bytes_per_element=1.0,
    paddle_dtype="bfloat16",
    amp_levels=("O1", "O2"),
    master_weights=True,
    loss_scaling=False,
    gemm_peak=("fp8",),
    other_peak=("bf16",),
    flash_attention=True,
    plannable=False,
    why_not="FP8 cannot be planned: fitting only (published Transformer Engine runs), "
    "PaddleNLP 2.8.1 has no FP8 training",
)


class Table:
    """Rows looked up by name and by code; codes are the rows' own, checked unique."""

    def __init__(self, rows: tuple[PrecisionRow, ...]):
        self.rows = rows
        self.by_name = {r.name: r for r in rows}
        self.by_code = {r.code: r for r in rows}
        if len(self.by_name) != len(rows) or len(self.by_code) != len(rows):
            raise ValueError("precision rows need unique names and codes")
        if min(self.by_code) < 0:
            raise ValueError("precision codes are non-negative")
        self.plannable = tuple(r.name for r in rows if r.plannable)

    def row(self, name: str) -> PrecisionRow:
        return self.by_name[name]

    def code(self, name: str) -> int:
        return self.by_name[name].code

    def name_of(self, code: Any) -> str:
        return self.by_code[int(code)].name

    def column(self, value: Callable[[PrecisionRow], Any], fill: Any = 0) -> np.ndarray:
        """An array indexed by code: `value(row)` at each row's code (`fill` in gaps), so
        `column(f)[codes]` maps a column of codes to their rows' values."""
        values = [fill] * (max(self.by_code) + 1)
        for r in self.rows:
            values[r.code] = value(r)
        out = np.array(values)
        out.flags.writeable = False
        return out


ROWS: tuple[PrecisionRow, ...] = (FP32, FP16, BF16, FP8)
TABLE = Table(ROWS)
# What a plan or a spec may choose, in the table's order (cheapest model state first).
PLANNABLE: tuple[str, ...] = TABLE.plannable


def row(name: str) -> PrecisionRow:
    return TABLE.row(name)


def code(name: str) -> int:
    return TABLE.code(name)


def name_of(code: Any) -> str:
    return TABLE.name_of(code)


@functools.cache
def column(field: str) -> np.ndarray:
    """A row attribute (field or property) as an array indexed by code (see Table.column)."""
    return TABLE.column(lambda r: getattr(r, field))


def of_codes(field: str, codes: Any) -> np.ndarray:
    """`field` of the row of each code in `codes` (a number or an array of them)."""
    return column(field)[np.asarray(codes, dtype=int)]


def paddle_dtype(name: str) -> PaddleDtype:
    """The dtype paddle.amp and fleet's amp config take for precision `name`."""
    return row(name).paddle_dtype


def amp_level(name: str, fp16_opt_level: str) -> AmpLevel | None:
    """The AMP level the runner applies: the plan's fp16_opt_level for a mixed precision, None
    (no AMP) for fp32."""
    for level in row(name).amp_levels:
        if level == fp16_opt_level:
            return level
    return None


def peak_tflops(peaks: Mapping[str, float], keys: tuple[str, ...]) -> float:
    """The first of `keys` a profile's [peak_tflops] states (0 = none)."""
    for key in keys:
        if peaks.get(key):
            return float(peaks[key])
    return 0.0


def refusal(name: object) -> str | None:
    """Why `name` cannot be a plan's precision (None when it can), with the allowed values."""
    allowed = ", ".join(repr(p) for p in PLANNABLE)
    if name in PLANNABLE:
        return None
    known = TABLE.by_name.get(name) if isinstance(name, str) else None
    if known:
        return f"{name!r}: {known.why_not}; allowed: {allowed}"
    return f"{name!r} is not a precision; allowed: {allowed}"


# ---- choosing between fp16 and bf16 by risk as well as cost -------------------------------------
# fp16's 5-bit exponent needs dynamic loss scaling, and large models trained in it diverge or
# spike where bf16 (fp32's exponent range) does not: BLOOM-176B switched to bf16 after its
# 104B fp16 trials diverged (Le Scao et al. 2022, "BLOOM", arXiv 2211.05100, sec. 3.5.2);
# OPT-175B trained in fp16 needed dozens of manual restarts after loss divergences (Zhang et
# al. 2022, arXiv 2205.01068, sec. 2.5 and its logbook); Gopher (Rae et al. 2021, arXiv
# 2112.11446, app. C.2) trained in bf16 with fp32 parameters for stability. The threshold is
# deliberately conservative, a full order of magnitude below the sizes in those reports: from
# 1B parameters a plan prefers bf16 wherever the hardware has it, and fp16 is chosen only when
# its modelled cost is more than FP16_MARGIN lower (a restart after a divergence costs a
# checkpoint interval and a human; 10% of the budget pays for several), or when the spec
# allows fp16 alone.
BF16_PREFERRED_ABOVE_PARAMS = 1e9
FP16_MARGIN = 0.10


def prefers_bf16(parameters: float) -> bool:
    """Whether a model of `parameters` prefers bf16 over fp16 at nearly equal cost."""
    return parameters >= BF16_PREFERRED_ABOVE_PARAMS


def label(name: str) -> str:
    """A precision as the chosen line names it: fp16 says it needs loss scaling."""
    return f"{name} with loss scaling" if row(name).loss_scaling else name
