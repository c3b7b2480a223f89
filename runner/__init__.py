"""runner: execute a plan TOML as real (distributed) Paddle GPT or Llama training."""

from gptplan import __version__  # noqa: F401  (one version for the project)
