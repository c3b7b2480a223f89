"""What the SkyPilot task asks for, as plain facts and functions the search prices: the boot
disk it sizes per node, and what the launcher attaches (EFA). No planner imports: the search
(planner.search, planner.pricebook) and the task writer (planner.skypilot) both read it, so the
disk the cost counts is the disk the task asks for.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

# Boot disk: the image (OS, CUDA, drivers), this project's venv with Paddle GPU, logs
IMAGE_GB = 50.0
DISK_HEADROOM = 1.25  # on the data parts, which are modelled
OFFSET_BYTES_PER_TOKEN = 0.5  # docs.npy + its side file, at >= 32 tokens a document


# The launcher and EFA (confirmed in SkyPilot's released wheels, sky/clouds/aws.py and
# sky/provision/aws/instance.py): 0.9.2 (the pin in constraints.txt) up to 0.10.2 have no EFA
# code and launch EC2 VMs with one plain network interface; 0.10.3 is the first release that
# attaches EFA, when the task sets `resources.network_tier: best` (PR skypilot-org/skypilot#6852,
# "Enable EFA automatically for AWS", merged 2025-08; it picks the Deep Learning Base AMI with
# the EFA drivers, and a custom image_id is refused). It attaches more than one EFA interface
# (p4d 4, p5 32, p5en 16) only when the nodes have no public IP, i.e. with `aws:
# use_internal_ips: true` in the user's SkyPilot config (~/.sky/config.yaml; a task cannot set
# it; PR #8475's hint and examples/aws_efa/README.md); otherwise one interface. SkyPilot 0.9.3
# and later need click < 8.2, which constraints.txt's pins exclude: the `cloud` extra stays at
# 0.9.2, and a plan costed on EFA is launched with a SkyPilot installed on its own (e.g.
# `uv tool install skypilot==0.10.3`). By default (constraints.launcher_attaches_efa = false)
# the planner costs such instances on what the pinned launcher gives (planner.search.launchable).
PINNED_SKYPILOT = "0.9.2"
EFA_SKYPILOT = "0.10.3"
EFA_SOURCES = (
    "SkyPilot 0.10.3 wheel (sky/clouds/aws.py: network_tier best -> max EFA interfaces; "
    "0.10.2 has no EFA code); skypilot-org/skypilot PR #6852 and examples/aws_efa/README.md"
)


def efa_requirement(instance: str) -> str:
    """What launching a plan costed on `instance`'s EFA needs (one sentence, the facts above)."""
    return (
        f"needs SkyPilot >= {EFA_SKYPILOT} (resources.network_tier: best attaches EFA; the "
        f"pinned {PINNED_SKYPILOT} attaches none, and {EFA_SKYPILOT} does not install with "
        "constraints.txt's pins: install it on its own, e.g. uv tool install "
        f"skypilot=={EFA_SKYPILOT}) and, for all of {instance}'s EFA interfaces (the planned "
        "bandwidth), aws: use_internal_ips: true in ~/.sky/config.yaml (else one interface)"
    )


def disk_parts(
    *,
    tokens: ArrayLike,
    vocab_size: int,
    params: float,
    master_weights: ArrayLike,
    keep_last: int,
    corpus_bytes: float,
) -> dict[str, np.ndarray]:
    """Bytes per node of what the boot disk holds besides the image (modelled): the prepared
    data (`tokens` x the id width + the document offsets), the checkpoints (keep_last + 1
    being written, cached locally by the bucket mount) and the corpus mount's read cache.
    Scalars or arrays (one value per candidate in the search)."""
    from gptplan.money import checkpoint_bytes

    width = 2 if vocab_size < 65535 else 4
    return {
        "prepared": np.asarray(tokens, dtype=float) * (width + OFFSET_BYTES_PER_TOKEN),
        "checkpoints": (keep_last + 1)
        * np.asarray(checkpoint_bytes(params, master_weights=master_weights), dtype=float),
        "corpus": np.asarray(float(corpus_bytes)),
    }


def disk_gb(parts: dict[str, np.ndarray]) -> np.ndarray:
    """The task's disk_size in GB: the image and venv + DISK_HEADROOM x the data parts."""
    data = parts["prepared"] + parts["checkpoints"] + parts["corpus"]
    return np.ceil(IMAGE_GB + DISK_HEADROOM * data / 1e9)


def candidate_disk_gb(
    *,
    corpus_tokens: float,
    corpus_bytes: float,
    trained_tokens: np.ndarray,
    vocab_size: int,
    params: float,
    master_weights: np.ndarray,
) -> np.ndarray:
    """disk_size per node of each search candidate, reckoned as `disk_plan` reckons the
    plan's (the corpus tokens when measured, else the trained tokens; the planned keep_last),
    so that the disk the task asks for is the disk the cost counts (planner.search._price)."""
    from gptplan.plan import CheckpointSection

    tokens = np.asarray(corpus_tokens if corpus_tokens else trained_tokens, dtype=float)
    return disk_gb(
        disk_parts(
            tokens=tokens,
            vocab_size=vocab_size,
            params=params,
            master_weights=master_weights,
            keep_last=CheckpointSection().keep_last,
            corpus_bytes=corpus_bytes,
        )
    )
