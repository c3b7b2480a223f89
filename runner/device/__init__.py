"""The rehearsal device: a Paddle custom device whose memory is host memory and whose collectives
really move data between the processes of this machine (docs/device.md).

Paddle's GPU-only distributed paths (tensor and pipeline parallel, sequence parallel, sharding
stage 2/3) run on it as they would on GPUs. The plugin is C++ (`src/`), compiled against the
installed Paddle wheel by `make setup` (`python -m runner.device build`) into a folder of this
environment; `env()` is what a launch needs to find it (`CUSTOM_DEVICE_ROOT`, never a global
setting), `capabilities()` says whether it is built and loadable and what it can run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paddle.base.core import task
    from paddle.distributed.communication.group import Group

DEVICE_TYPE = "gptplan_cpu"
LIBRARY = f"lib{DEVICE_TYPE}.so"
SOURCES = ("runtime.cc", "kernels.cc")
HEADERS = ("device_name.h", "kernel_list.h")
SRC_DIR = Path(__file__).resolve().parent / "src"
STAMP = "build.json"
# every wait of a collective ends by this deadline (seconds) when a peer is dead or hung
TIMEOUT_ENV = "GPTPLAN_DEVICE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0

# The layout kinds the device runs, each checked against a 1-process reference by
# tests/test_device.py (fp32). AMP (bf16, fp16; O1, O2) runs with each through the device's
# upcasting kernels (src/kernels.cc; tests/test_device_amp.py: tensor + sequence parallel and
# sharding stage 1, tests/test_rehearsal_device_e2e.py: data parallel).
LAYOUT_KINDS = (
    "dp",
    "tp",
    "sp",
    "pp",
    "vpp",
    "sharding_stage1",
    "sharding_stage2",
    "sharding_stage3",
)
PRECISIONS = ("fp32", "bf16", "fp16")
# layout kinds AMP does not run with on the device -> why (a rehearsal of such a layout trains
# in fp32 and its change list says why: runner.rehearsal.amp_blocked_by). None today: tensor
# parallel (Paddle's custom-device c_identity, mp_allreduce_sum, c_softmax_with_cross_entropy
# have no bf16 kernel) and fleet's sharding stage 1 with fp32 gradients under a loss scaler
# (Paddle's CPU check_finite_and_unscale left them on the CPU) were here until the device got
# its own kernels for them.
AMP_WITHOUT: dict[str, str] = {}


class DeviceBuildError(RuntimeError):
    """The plugin could not be built here (no compiler, no Paddle headers, a compile error)."""


def install_dir() -> Path:
    """Where the plugin is installed: inside the virtual environment when there is one, else in
    the user data directory (never a global location)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "lib" / "gptplan-device"
    from gptplan import userdata

    return userdata.data_dir() / "device"


def _paddle_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("paddle")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _paddle_version(paddle_dir: Path) -> str:
    # read without importing Paddle (its import loads every custom device found)
    text = (paddle_dir / "version" / "__init__.py").read_text(encoding="utf-8", errors="replace")
    for line in text.splitlines():
        if line.startswith("full_version"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"


def source_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((SRC_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build(target: Path | None = None, *, quiet: bool = False) -> Path:
    """Compile the plugin against the installed Paddle wheel into `target` (default
    install_dir()); returns the library's path. Raises DeviceBuildError with the reason."""
    target = target or install_dir()
    cxx = compiler()
    if cxx is None:
        raise DeviceBuildError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    paddle_dir = _paddle_dir()
    if paddle_dir is None:
        raise DeviceBuildError("Paddle is not installed in this environment")
    include = paddle_dir / "include"
    lib_dir = paddle_dir / "base"
    if not (include / "paddle" / "phi" / "backends" / "device_ext.h").is_file():
        raise DeviceBuildError(
            f"this Paddle wheel has no plugin headers ({include} lacks device_ext.h)"
        )
    if not (lib_dir / "libpaddle.so").is_file():
        raise DeviceBuildError(f"this Paddle wheel has no {lib_dir / 'libpaddle.so'}")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        out = Path(tmp) / LIBRARY
        cmd = [
            cxx,
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-DPADDLE_WITH_CUSTOM_DEVICE",
            f"-I{include}",
            f"-I{include / 'third_party'}",
            f"-I{SRC_DIR}",
            *(str(SRC_DIR / s) for s in SOURCES),
            f"-L{lib_dir}",
            "-l:libpaddle.so",
            f"-Wl,-rpath,{lib_dir}",
            "-o",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise DeviceBuildError(f"{cxx} failed (exit {proc.returncode}):\n{tail}")
        os.replace(out, target / LIBRARY)
    stamp = {
        "device_type": DEVICE_TYPE,
        "source_digest": source_digest(),
        "paddle_version": _paddle_version(paddle_dir),
        "paddle_dir": str(paddle_dir),
        "compiler": cxx,
    }
    (target / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
    if not quiet:
        print(f"rehearsal device built: {target / LIBRARY}")
    return target / LIBRARY


def _state() -> tuple[bool, str]:
    """(built and current, reason if not) from the files only; imports nothing."""
    root = install_dir()
    lib = root / LIBRARY
    if not lib.is_file():
        return False, f"the rehearsal device is not built ({lib} missing; run `make setup`)"
    try:
        stamp = json.loads((root / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, f"the rehearsal device at {root} has no build record; run `make setup`"
    if stamp.get("source_digest") != source_digest():
        return False, "the rehearsal device was built from older sources; run `make setup`"
    paddle_dir = _paddle_dir()
    if paddle_dir is None:
        return False, "Paddle is not installed in this environment"
    if stamp.get("paddle_version") != _paddle_version(paddle_dir):
        return False, "the rehearsal device was built for another Paddle version; run `make setup`"
    return True, ""


def env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process (or `paddle.distributed.launch`) that runs on the device.

    Without a device launch uses: `--devices 0,1,...` (Paddle then picks the xccl backend and
    places rank i on `gptplan_cpu:i`)."""
    out = dict(os.environ if base is None else base)
    out["CUSTOM_DEVICE_ROOT"] = str(install_dir())
    # the first transpose would look up a stride `contiguous` kernel, which has no CPU fallback
    out["FLAGS_use_stride_kernel"] = "0"
    out.setdefault(TIMEOUT_ENV, str(int(DEFAULT_TIMEOUT_S)))
    return out


def cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process that must NOT load the device (a plain CPU reference)."""
    out = dict(os.environ if base is None else base)
    out["CUSTOM_DEVICE_ROOT"] = ""
    return out


_LOADABLE: dict[str, tuple[bool, str]] = {}
# A record, next to the build's, that Paddle loaded this very library (the same build, Paddle
# and files): later processes skip the child Python that checks it (several seconds each: every
# `runner execute --local` and every rehearsal test asked again). Only a success is recorded.
LOADED = "loaded.json"


def _load_key() -> dict[str, object] | None:
    """What a recorded load is valid for: the build record and the two libraries' files."""
    root = install_dir()
    paddle_dir = _paddle_dir()
    if paddle_dir is None:
        return None
    try:
        key: dict[str, object] = {
            "build": json.loads((root / STAMP).read_text(encoding="utf-8")),
            "python": sys.executable,
        }
        for name, path in (
            ("plugin", root / LIBRARY),
            ("paddle", paddle_dir / "base" / "libpaddle.so"),
        ):
            st = path.stat()
            key[name] = [str(path), st.st_size, st.st_mtime_ns]
    except (OSError, ValueError):
        return None
    return key


def _recorded_load(key: dict[str, object] | None) -> bool:
    if key is None:
        return False
    try:
        return bool(json.loads((install_dir() / LOADED).read_text(encoding="utf-8")) == key)
    except (OSError, ValueError):
        return False


def _record_load(key: dict[str, object] | None) -> None:
    if key is None:
        return
    target = install_dir() / LOADED
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".loaded-")
    except OSError:  # a read-only install: checked again next time
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(key, f)
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _loadable() -> tuple[bool, str]:
    """Loads the plugin in a child Python (never in this process: loading it needs Paddle),
    unless a previous process recorded that Paddle loaded this same build (LOADED)."""
    key = str(install_dir())
    if key not in _LOADABLE:
        record = _load_key()
        if _recorded_load(record):
            _LOADABLE[key] = (True, "")
            return _LOADABLE[key]
        code = (
            "import paddle, sys\n"
            f"sys.exit(0 if {DEVICE_TYPE!r} in paddle.device.get_all_custom_device_type() else 3)\n"
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=300
            )
            ok = proc.returncode == 0
            why = (
                ""
                if ok
                else "Paddle did not load the rehearsal device: "
                + (proc.stderr.strip().splitlines() or ["?"])[-1]
            )
        except subprocess.TimeoutExpired:
            ok, why = False, "loading the rehearsal device took over 300 s"
        if ok:
            _record_load(record)
        _LOADABLE[key] = (ok, why)
    return _LOADABLE[key]


def available(*, check_load: bool = False) -> bool:
    ok, _ = _state()
    if ok and check_load:
        ok, _ = _loadable()
    return ok


def capabilities(*, check_load: bool = False) -> dict:
    """What the device can do here, as a JSON-able dict: built/loadable, its device type, the
    layout kinds and precisions it runs, and the environment a launch on it needs."""
    ok, why = _state()
    if ok and check_load:
        ok, why = _loadable()
    return {
        "available": ok,
        "reason": why,
        "device_type": DEVICE_TYPE,
        "root": str(install_dir()),
        "layout_kinds": list(LAYOUT_KINDS) if ok else [],
        "precisions": list(PRECISIONS) if ok else [],
        "amp_without": dict(AMP_WITHOUT) if ok else {},
        "max_processes": 8,
        "env": {k: v for k, v in env({}).items()} if ok else {},
    }


def launch_devices(nprocs: int) -> str:
    """The `--devices` argument of `paddle.distributed.launch` for `nprocs` ranks."""
    return ",".join(str(i) for i in range(nprocs))


_HOOKED = False


def install_paddle_hooks() -> None:
    """Call once in every process that trains on the device, after importing Paddle.

    Paddle 3.3.1's custom-device process group does not pass its coalescing (the batched
    send/recv of pipeline schedules, `_coalescing_manager`) on to the plugin, so a ring of
    "recv then send" batches (the interleaved schedule's last stage -> first stage) would leave
    every rank blocked in its recv until the deadline. This brackets Paddle's coalescing with
    the device's group start/end, which runs the batch's sends before its receives."""
    global _HOOKED
    if _HOOKED:
        return
    import contextlib
    import ctypes
    import importlib

    # the modules (the package re-exports a function of the same name)
    batch_isend_irecv = importlib.import_module(
        "paddle.distributed.communication.batch_isend_irecv"
    )
    p2p_communication = importlib.import_module(
        "paddle.distributed.fleet.meta_parallel.pp_utils.p2p_communication"
    )

    lib = ctypes.CDLL(str(install_dir() / LIBRARY))  # the copy Paddle loaded (same file)
    original = batch_isend_irecv._coalescing_manager

    @contextlib.contextmanager
    def coalescing(group: Group | None, tasks: task | None = None) -> Iterator[None]:
        with original(group, tasks):
            if lib.gptplan_device_group_start() != 0:
                raise RuntimeError("the rehearsal device refused group_start")
            try:
                yield
            finally:
                if lib.gptplan_device_group_end() != 0:
                    raise RuntimeError(
                        "a batched send/recv on the rehearsal device failed (its log line says why)"
                    )

    for module in (batch_isend_irecv, p2p_communication):
        module.__dict__["_coalescing_manager"] = coalescing
    allow_bfloat16_amp()
    clip_bfloat16_gradients()
    _HOOKED = True


def allow_bfloat16_amp() -> None:
    """Let Paddle's AMP run bf16 on the device: Paddle 3.3.1 enables bf16 on a custom device
    only for a fixed list of device types (`paddle.amp.auto_cast._is_custom_device_bfloat16_
    supported`: npu, intel_hpu, iluvatar_gpu, metax_gpu) and otherwise warns "CustomPlace only
    support float16 amp." and trains in fp32. The device's bf16 kernels (its own upcasting ones
    where Paddle's CPU build has none, kernels.cc) make bf16 run here, so its type joins the
    list. auto_cast and decorate read the function from their module at each call."""
    import importlib

    auto_cast = importlib.import_module("paddle.amp.auto_cast")
    original = auto_cast._is_custom_device_bfloat16_supported
    if getattr(original, "_gptplan_device", False):
        return

    def supported() -> bool:
        place = auto_cast._current_expected_place()
        return place.get_device_type() == DEVICE_TYPE or bool(original())

    supported._gptplan_device = True  # type: ignore[attr-defined]
    auto_cast.__dict__["_is_custom_device_bfloat16_supported"] = supported


class _NotACustomPlace:
    """The current place, seen as no custom place (delegates everything else to it)."""

    def __init__(self, place: object) -> None:
        self._place = place

    def __getattr__(self, name: str) -> object:
        return getattr(self._place, name)


def clip_bfloat16_gradients() -> None:
    """Paddle 3.3.1's hybrid-parallel gradient clip (`HybridParallelClipGrad._comm_and_clip`,
    pipeline and sharding layouts) makes its bf16 clip factor only on GPUs and a fixed list of
    custom device types, and otherwise fails on a bf16 gradient ("cannot access local variable
    'clip_var_bf16'"). On the device it runs as on a GPU: during the call, the place it asks
    `paddle.framework._current_expected_place()` for is not seen as a custom place."""
    import importlib

    import paddle

    module = importlib.import_module(
        "paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer"
    )
    clip = module.HybridParallelClipGrad
    original = clip._comm_and_clip
    if getattr(original, "_gptplan_device", False):
        return
    framework = paddle.framework

    def comm_and_clip(self: Any, *args: Any, **kwargs: Any) -> Any:
        real = framework._current_expected_place
        place = real()
        if getattr(place, "get_device_type", lambda: "")() != DEVICE_TYPE:
            return original(self, *args, **kwargs)
        framework._current_expected_place = lambda: _NotACustomPlace(place)
        try:
            return original(self, *args, **kwargs)
        finally:
            framework._current_expected_place = real

    comm_and_clip._gptplan_device = True  # type: ignore[attr-defined]
    clip._comm_and_clip = comm_and_clip


def activate_if_on_device() -> bool:
    """For a training process: True (and the hooks installed) when Paddle placed it on the
    device (a launch with env() and `--devices`), False on any other device."""
    import paddle

    if not str(paddle.get_device()).startswith(DEVICE_TYPE + ":"):
        return False
    install_paddle_hooks()
    return True


def off_device(model: Any, optimizer: Any, device_type: str = DEVICE_TYPE) -> list[str]:
    """Every parameter (a stage-3 parameter's slice too), gradient, optimizer state and master
    weight of this rank that is not on the device (a stage-3 parameter's released storage is
    not counted): what a rehearsal and the self-test check, since a matching loss alone proves
    nothing (docs/device.md)."""
    bad = []

    def check(kind: str, name: str, t: Any) -> None:
        # a released stage-3 parameter has no place (asking raises): test that first
        if t is None or not hasattr(t, "_is_initialized") or not t._is_initialized():
            return
        if f"Place({device_type}:" not in str(t.place):
            bad.append(f"{kind} {name} on {t.place}")

    for name, p in model.named_parameters():
        check("parameter", name, p)
        check("parameter slice", name, getattr(p, "fw_storage", None))
        check("gradient", name, p.grad)
    seen = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        for acc_name, per_param in getattr(opt, "_accumulators", {}).items():
            for pname, t in per_param.items():
                check("optimizer state", f"{acc_name}/{pname}", t)
        for pname, t in getattr(opt, "_master_weights", {}).items():
            check("master weight", pname, t)
        opt = getattr(opt, "_inner_opt", None) or getattr(opt, "_optim", None)
    return bad
