"""An install without the source tree: the wheel, installed into a fresh virtual environment
outside the checkout, plans the bank-FAQ job and imports prices into the user data directory,
leaving the installed package untouched.

The wheel is built once with the project's own build backend (setuptools.build_meta, what
`python -m build` runs; here through `pip wheel --no-build-isolation`, offline and in seconds)
from a copy of the sources. The fresh environment has no pip and none of the dependencies: it
reads them from this interpreter's site-packages through a .pth line (no .pth file there is
run, so an editable install of the checkout stays invisible), and the wheel is installed into
it with `pip --python`. With `pip install -e .` the shipped data is the checkout's own
hardware_profiles/ (PROFILE_DIR next to gptplan/); in the wheel it is
site-packages/hardware_profiles, found the same way.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_user_data import CATALOG, tree

pytestmark = pytest.mark.install

SOURCES = ("pyproject.toml", "README.md", "gptplan", "planner", "runner", "hardware_profiles")


def _run(args: list, *, cwd: Path, env: dict | None = None, timeout: float = 600):
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with only the wheel installed; its bin/ folder."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "local", "*.egg-info")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    # what an older `make demo` left in a checkout: never shipped
    (src / "hardware_profiles" / "local").mkdir(exist_ok=True)
    (src / "hardware_profiles" / "local" / "cpu.toml").write_text("[efficiency]\nmax = 0.9\n")
    wheels = root / "wheels"
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", wheels, src],
        cwd=root,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = wheels.glob("gptplan-*.whl")
    venv = root / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    assert made.returncode == 0, made.stderr
    (packages,) = venv.glob("lib/python*/site-packages")
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (packages / "_deps_from_the_test_environment.pth").write_text("\n".join(deps) + "\n")
    python = venv / "bin" / "python"
    install = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
        cwd=root,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    return venv / "bin"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_the_wheel_plans_and_imports_prices_outside_the_checkout(installed, tmp_path):
    """Before: the wheel had no hardware_profiles/ (`planner optimize` could not plan) and
    `planner prices import` wrote into the package."""
    where = _run(
        [
            installed / "python",
            "-c",
            "import gptplan, planner.spec as s; from gptplan.profile import PROFILE_DIR; "
            "print(gptplan.__file__); print(PROFILE_DIR); print(s.EMBEDDED_SPEC)",
        ],
        cwd=tmp_path,
        env=_env(),
    )
    assert where.returncode == 0, where.stderr
    venv = installed.parent
    module, profiles, spec = (Path(line) for line in where.stdout.split())
    assert all(p.is_relative_to(venv) for p in (module, profiles, spec)), where.stdout
    assert not any(p.is_relative_to(REPO) for p in (module, profiles, spec))
    assert (profiles / "published_runs.csv").is_file() and spec.is_file()
    assert not (profiles / "local").exists()
    shipped = tree(profiles)
    assert "offers/lambda.toml" in shipped and "spot/interruptions.toml" in shipped

    plan = _run([installed / "planner", "optimize", "--budget", "12000"], cwd=tmp_path, env=_env())
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert (tmp_path / "plans" / "bank_faq.toml").is_file()

    catalog = tmp_path / "catalogs" / "v6" / "aws" / "vms.csv"
    catalog.parent.mkdir(parents=True)
    catalog.write_text(CATALOG)
    imported = _run(
        [installed / "planner", "prices", "import", catalog, "--as-of", "2026-12-01"],
        cwd=tmp_path,
        env=_env(),
    )
    assert imported.returncode == 0, imported.stderr
    data = Path(os.environ["GPTPLAN_DATA_DIR"])
    assert (data / "offers" / "aws.toml").is_file() and str(data) in imported.stdout
    assert tree(profiles) == shipped  # the installed package is never written
    listed = _run([installed / "planner", "profiles"], cwd=tmp_path, env=_env())
    assert listed.returncode == 0 and "p5.48xlarge" in listed.stdout, listed.stderr
