"""runner: execute a plan TOML as real (distributed) Paddle GPT training."""

__version__ = "0.1.0"


def quiet_third_party_warnings() -> None:
    """Paddle and setuptools print install-time warnings (ccache, distutils) on every import;
    they say nothing about the run, so the CLIs hide them."""
    import warnings

    warnings.filterwarnings("ignore", message=".*ccache.*")
    warnings.filterwarnings("ignore", message=".*Setuptools is replacing distutils.*")
