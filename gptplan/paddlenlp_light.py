"""PaddleNLP's models and tokenizers without the rest of PaddleNLP, in the processes we start.

`import paddlenlp` runs PaddleNLP 2.8.1's package `__init__`, which imports every subpackage:
Taskflow (and through it scikit-learn and seqeval), data augmentation, the model server,
metrics, prompt tuning, the Trainer. None of them builds a model or a tokenizer. On this machine
`import paddlenlp` takes 5.3 s of CPU, Paddle with PaddleNLP's `data` and `transformers` 3.1 s
(`/usr/bin/time python -c ...`, 2026-12-06), and every rank, the runner (its tokenizer), the
export and the sample pay it once per process: a 2-process `runner execute --export` of the test
plan went from 14.6 to 9.7 s of CPU.

`enable()` says that this process may load PaddleNLP light; the entry points of the processes
this project starts call it (the runner, each launched rank and probe, the probe worker, the
device self-test). `load()` then registers the `paddlenlp` package without running its
`__init__`, imports `data` and `transformers` in PaddleNLP's own order (`data` first: its
collator imports `transformers`, which imports back), and does what the `__init__` does that
matters here: the version string, and `paddle.disable_signal_handler()` (Paddle's C handlers for
SIGTERM and SIGSEGV would otherwise stay installed). Submodules import as usual afterwards
(`paddlenlp.transformers.llama.modeling_pp`, `paddlenlp.utils.log`).

Two limits, hence the opt-in: in a light process the Trainer is imported through
`trainer_utils()` (PaddleNLP's Trainer, peft and prompt packages import each other, and only
`prompt` first resolves the cycle); and a process that did not call `enable()` (a user's
notebook, the test runner) imports PaddleNLP whole, as it always did. Where the light import
fails (another PaddleNLP), the partial import is removed and PaddleNLP is imported whole. A
process that imported `paddlenlp` already keeps it as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

_ENABLED = {"light": False}


def enable() -> None:
    """This process may load PaddleNLP light (call it at a process's entry, before anything
    imports PaddleNLP)."""
    _ENABLED["light"] = True


def load() -> ModuleType:
    """`paddlenlp.transformers`: light where `enable()` was called and PaddleNLP is not
    imported yet, else PaddleNLP's usual import (idempotent)."""
    if "paddlenlp" not in sys.modules and _ENABLED["light"]:
        try:
            _load_light()
        except Exception:
            _forget()
    return importlib.import_module("paddlenlp.transformers")


def import_module(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with PaddleNLP loaded by `load()` first when `name` is
    one of its modules (a family's classes: 'paddlenlp.transformers.llama.modeling')."""
    if name == "paddlenlp" or name.startswith("paddlenlp."):
        load()
    return importlib.import_module(name)


def trainer_utils() -> ModuleType:
    """`paddlenlp.trainer.trainer_utils` (tensor-parallel seeds), in a light process too. The
    Trainer package imports peft, which imports prompt, which imports the Trainer back:
    PaddleNLP's own `__init__` imports `prompt` before the Trainer, and so does this."""
    load()
    importlib.import_module("paddlenlp.prompt")
    return importlib.import_module("paddlenlp.trainer.trainer_utils")


def is_light() -> bool:
    """Whether this process's PaddleNLP skipped the package `__init__`."""
    package = sys.modules.get("paddlenlp")
    return package is not None and getattr(package, "_gptplan_light", False)


def _version() -> str:
    """PaddleNLP's `__version__` as its `__init__` sets it (2.8.1: "2.8.1.post", or "2.8.1"
    with PADDLENLP_STABLE_VERSION set); configuration_utils writes it into saved configs."""
    from importlib.metadata import version

    return version("paddlenlp") + ("" if os.getenv("PADDLENLP_STABLE_VERSION") else ".post")


def _load_light() -> None:
    import paddle

    spec = importlib.util.find_spec("paddlenlp")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        raise ImportError("paddlenlp is not installed")
    package = importlib.util.module_from_spec(spec)
    package.__version__ = _version()  # type: ignore[attr-defined]
    package._gptplan_light = True  # type: ignore[attr-defined]
    sys.modules["paddlenlp"] = package
    importlib.import_module("paddlenlp.data")
    importlib.import_module("paddlenlp.transformers")
    paddle.disable_signal_handler()


def _forget() -> None:
    for name in [n for n in sys.modules if n == "paddlenlp" or n.startswith("paddlenlp.")]:
        del sys.modules[name]
