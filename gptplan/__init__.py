"""gptplan: the shared core under the two tools (planner, runner).

What both tools use and neither owns: the plan and spec schema, strict TOML mapping, errors,
CLI helpers, model facts per family, the hardware-profile reader, corpus and tokenizer, and the
cost formulas (memory, step time, money). Imports neither `planner` nor `runner`.
"""

__version__ = "0.1.0"


def quiet_third_party_warnings() -> None:
    """Paddle and setuptools print install-time warnings (ccache, distutils) on every import;
    they say nothing about the run, so the CLIs hide them."""
    import os
    import warnings

    warnings.filterwarnings("ignore", message=".*ccache.*")
    warnings.filterwarnings("ignore", message=".*Setuptools is replacing distutils.*")
    # the same for the processes we start (data-preparation workers, launcher, ranks)
    quiet = ["ignore:No ccache found", "ignore:Setuptools is replacing distutils"]
    current = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(current + [w for w in quiet if w not in current])
