"""runner: execute a plan TOML as real (distributed) Paddle GPT training."""

__version__ = "0.1.0"
