"""What the shared flags override: the spec keys (`spec_overrides`, `--set` values as TOML, never
evaluated), the autotuning settings (range-checked by their schema), this machine's profile,
and the check that an output path can be written."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import tomli

from gptplan.errors import UserError

if TYPE_CHECKING:  # annotations only
    from planner.tuning.autotune import TuneSettings
from planner.commands.flags import FLAGS, TUNE_FLAGS


def check_writable_file(path: Path, *, key: str) -> None:
    """Before any work: the output path must be a file path whose folders are folders."""
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"{str(path)!r} is a folder; give a file path such as {path / 'plan.toml'}", key=key
        )
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{str(path)!r}: {parent} is a file, not a folder", key=key)


def spec_overrides(args: argparse.Namespace) -> dict:
    """The spec keys the flags set (in the order a reader lists them), each flag's name kept in
    `args.overridden` so an error in its value names the flag, not the spec file."""
    out: dict = {}
    _constraint_overrides(args, out)
    rate_keys = _rate_overrides(args, out)
    if getattr(args, "spot_fallback_hours", None) is not None:
        out["spot.fallback_wait_hours"] = args.spot_fallback_hours
    if getattr(args, "top", None) is not None:  # checked by the spec's range (search.top)
        out["search.top"] = args.top
    set_keys = _set_overrides(args, out)
    args.overridden = {
        k: set_keys.get(k) or rate_keys.get(k) or FLAGS.get(k, f"--set {k}") for k in out
    }
    return out


def _constraint_overrides(args: argparse.Namespace, out: dict) -> None:
    if args.budget is not None:
        out["constraints.budget"] = args.budget
    if args.deadline_hours is not None:
        out["constraints.deadline_hours"] = args.deadline_hours
    if args.currency is not None:
        out["constraints.currency"] = args.currency
    if args.hardware is not None:
        out["constraints.profiles"] = [h.strip() for h in args.hardware.split(",") if h.strip()]
        if not out["constraints.profiles"]:
            raise UserError(
                f"{args.hardware!r} names no profile; give comma-separated names "
                "(see 'planner profiles')",
                key="--hardware",
            )
    if args.spot is not None:
        out["constraints.spot"] = args.spot
    if args.target_tokens is not None:
        out["job.target_tokens"] = args.target_tokens
    if getattr(args, "allow_outlier_prices", None):
        out["constraints.allow_outlier_prices"] = True
    if getattr(args, "any_region", None):
        out["constraints.any_region"] = True


def _rate_overrides(args: argparse.Namespace, out: dict) -> dict[str, str]:
    """--rate CODE=RATE and --rate-date into [rates]; returns the keys --rate set."""
    rate_keys = {}
    for item in getattr(args, "rate", []) or []:
        code, sep, raw = item.partition("=")
        try:
            value = float(raw) if sep else None
        except ValueError:
            value = None
        if value is None:
            raise UserError(f"{item!r}: use CODE=RATE, e.g. --rate EUR=7.9", key="--rate")
        out[f"rates.{code.strip()}"] = value  # checked as [rates] are (ISO code, number > 0)
        rate_keys[f"rates.{code.strip()}"] = "--rate"
    if getattr(args, "rate_date", None) is not None:
        from planner.market.pricebook import price_date

        if price_date(args.rate_date) is None:
            raise UserError(
                f"{args.rate_date!r} is not a date; use YYYY-MM-DD, YYYY-MM or YYYY",
                key="--rate-date",
            )
        out["rates.as_of"] = args.rate_date
    if rate_keys:
        given = ", ".join(f"{k.split('.', 1)[1]}={v:g}" for k, v in out.items() if k in rate_keys)
        out["rates.source"] = f"command line --rate {given} (other rates: the spec's [rates])"
    return rate_keys


def _set_overrides(args: argparse.Namespace, out: dict) -> dict[str, str]:
    """--set SECTION.KEY=VALUE (a TOML value, never evaluated); returns the keys it set."""
    set_keys: dict[str, str] = {}
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise UserError(f"{item!r}: use SECTION.KEY=VALUE", key="--set")
        try:  # TOML syntax for the value; never eval
            value = tomli.loads(f"v = {raw}")["v"]
        except tomli.TOMLDecodeError:
            value = raw
        out[key] = value
        set_keys[key] = f"--set {key}"  # named as given, even where a flag sets that key too
    return set_keys


def tune_settings(args: argparse.Namespace) -> TuneSettings:
    """The autotuning flags, range-checked by TuneSettings' schema (errors name the flag)."""
    from planner.tuning.autotune import tune_settings_from

    table = {
        "probes": args.probes,
        "probe_time_s": args.probe_time,
        "trials": args.trials,
        "seed": args.seed,
        "storage": args.storage,
        "multi_objective": args.multi_objective,
        "timeout_s": args.probe_timeout,
    }
    try:
        return tune_settings_from(table)
    except UserError as exc:
        key = exc.key or ""  # the settings' key, e.g. settings.probes
        exc.file, exc.key = None, TUNE_FLAGS[key.split(".", 1)[1]]
        raise


def local_profile_name(args: argparse.Namespace) -> str:
    import paddle

    if args.local_profile:
        return args.local_profile
    return "" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() else "cpu"
