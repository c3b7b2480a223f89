"""What this machine can rehearse, and how a rehearsal is launched on it.

`support()` answers once per process: the layout kinds and precisions a local run can use here.
Two ways exist (facts in the project's CPU_DEVICE notes):

- the rehearsal device: the project's Paddle custom-device plugin (built by `make setup`),
  whose device is host memory and whose collectives really move data; it runs every layout
  kind (tensor, pipeline incl. interleaved, sequence parallel, sharding stages 1-3, data
  parallel, recompute), in fp32, bf16 and fp16 (AMP O1/O2 through its upcasting kernels; a
  layout kind it could not run AMP with would be in `Support.amp_without`);
- plain CPU (gloo): data parallel and sharding stage 1 only (Paddle's CPU build has no
  `c_identity`, gloo no send/recv, `group_sharded_parallel` asserts a GPU).

The package (runner.device: `capabilities()`) says whether the plugin is built and gives the
launch environment; this module only reads its answer, so the layout mapping (runner.rehearsal)
stays pure: its tests pass a Support of their own. Importing it imports no Paddle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gptplan.plan import Plan

# Layout kinds, named once (runner.rehearsal.layout_kinds reads a plan into these).
TENSOR = "tensor parallel"
SEQUENCE = "sequence parallel"
PIPELINE = "pipeline parallel"
INTERLEAVED = "interleaved pipeline (virtual stages)"
STAGE1 = "sharding stage1"
STAGE2 = "sharding stage2"
STAGE3 = "sharding stage3"
DATA = "data parallel"
RECOMPUTE = "recompute"
ALL_KINDS = frozenset({TENSOR, SEQUENCE, PIPELINE, INTERLEAVED, STAGE1, STAGE2, STAGE3, DATA})
CPU_KINDS = frozenset({DATA, STAGE1})  # plain CPU with gloo
# Processes a rehearsal runs at most: the 4-process hybrids (dp2 x mp2, sharding2 x mp2 + sp,
# pp2 x mp2, dp2 x pp2) ran on a 2-core machine; 8 would only time-share the same cores.
MAX_RANKS = 4


@dataclass(frozen=True)
class Support:
    """What a local run can use here."""

    device: str  # the plugin's device type ('' = plain CPU)
    kinds: frozenset[str]  # layout kinds that run here
    precisions: tuple[str, ...]  # precisions that really train here (not fp32 under a name)
    why_not: str = ""  # why the device is not used ('' when it is)
    # layout kinds AMP (bf16/fp16) does not run with here -> why (the device's amp_without)
    amp_without: dict[str, str] = field(default_factory=dict)
    max_ranks: int = MAX_RANKS
    env: dict[str, str] = field(default_factory=dict)  # for the launcher and every rank

    @property
    def on_device(self) -> bool:
        return bool(self.device)


def local_precisions() -> list[str]:
    """Precisions a plain-CPU run really trains in: fp32 only. Paddle's AMP is a no-op on CPU
    ("amp_guard can only be enabled on CUDAPlace, XPUPlace, and CustomPlace"), so a bf16 or
    fp16 run here would be the fp32 run under another name."""
    return ["fp32"]


PLAIN_CPU = Support(device="", kinds=CPU_KINDS, precisions=tuple(local_precisions()), max_ranks=2)


# runner.device's names for the layout kinds (its capabilities()['layout_kinds'])
DEVICE_KIND_NAMES = {
    "dp": DATA,
    "tp": TENSOR,
    "sp": SEQUENCE,
    "pp": PIPELINE,
    "vpp": INTERLEAVED,
    "sharding_stage1": STAGE1,
    "sharding_stage2": STAGE2,
    "sharding_stage3": STAGE3,
}


@functools.lru_cache(maxsize=1)
def support() -> Support:
    """This machine's answer: runner.device.capabilities() (built, and loadable by Paddle in a
    child process) when the plugin is there, else plain CPU with the reason."""
    from runner import device

    return support_from(device.capabilities(check_load=True))


def support_from(caps: dict) -> Support:
    """The Support of the device's capabilities() answer."""
    if not caps.get("available"):
        return _plain(str(caps.get("reason") or "the rehearsal device is not built"))
    return Support(
        device=str(caps["device_type"]),
        kinds=frozenset(
            DEVICE_KIND_NAMES[k] for k in caps["layout_kinds"] if k in DEVICE_KIND_NAMES
        ),
        precisions=tuple(caps["precisions"]),
        amp_without={
            DEVICE_KIND_NAMES[k]: str(v)
            for k, v in dict(caps.get("amp_without") or {}).items()
            if k in DEVICE_KIND_NAMES
        },
        max_ranks=min(MAX_RANKS, int(caps.get("max_processes", MAX_RANKS))),
        env={str(k): str(v) for k, v in caps["env"].items()},
    )


def _plain(why: str) -> Support:
    return Support(
        device="",
        kinds=PLAIN_CPU.kinds,
        precisions=PLAIN_CPU.precisions,
        why_not=why,
        max_ranks=PLAIN_CPU.max_ranks,
    )


def uses_device(plan: Plan) -> bool:
    """Whether `plan` runs on the rehearsal device: a CPU plan whose hardware.profile is
    gptplan.plan.REHEARSAL_PROFILE (runner.rehearsal.localize writes it when the device is
    built)."""
    from gptplan.plan import REHEARSAL_PROFILE

    return plan.hardware.device == "cpu" and plan.hardware.profile == REHEARSAL_PROFILE


def require_device(*, key: str, instead: str) -> Support:
    """support() with the device on; else HardwareError (one line naming `key`): why it is
    unavailable, how to build it, and `instead` (what plain CPU does)."""
    sup = support()
    if not sup.on_device:
        from gptplan.errors import HardwareError
        from gptplan.plan import REHEARSAL_PROFILE

        raise HardwareError(
            f"{REHEARSAL_PROFILE!r} runs on the rehearsal device, which is unavailable here "
            f"({sup.why_not}); build it with `make setup`, or {instead} (data parallel and "
            "sharding stage1 only)",
            key=key,
        )
    return sup


def launch_env(plan: Plan) -> dict[str, str]:
    """What the launcher and every rank need to run `plan` on the rehearsal device ({} when
    it does not use it); HardwareError when it should and the device is unavailable."""
    if not uses_device(plan):
        return {}
    sup = require_device(key="hardware.profile", instead="rehearse with --local on plain CPU")
    return dict(sup.env)
