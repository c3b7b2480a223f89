"""`planner estimate`: evaluate one fully given configuration (a plan's own, or the spec's
space with --set values pinned) with the cost model, no probes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from planner.commands.flags import spec_args
from planner.commands.overrides import spec_overrides

if TYPE_CHECKING:  # annotations only
    from gptplan.plan import Plan

NAME = "estimate"


def add_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser(NAME, help="evaluate one fully given configuration")
    spec_args(est)
    est.add_argument("--plan", type=Path, default=None, help="estimate an existing plan")
    est.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="spec override (TOML value), e.g. --set search.micro_batch_sizes=[8]",
    )
    est.add_argument("--json", action="store_true")
    est.add_argument(
        "--memory",
        action="store_true",
        help="the modelled memory per device term by term, and the change that frees the most",
    )


def run(args: argparse.Namespace) -> int:
    from gptplan.plan import load_plan
    from planner.pipeline import optimize
    from planner.reporting.answer import optimize_json
    from planner.reporting.costreport import fit_lines
    from planner.reporting.report import render_candidates, render_choice, render_model
    from planner.spec import load_spec

    overrides = {}
    spec_path = args.spec
    if args.plan:
        plan = load_plan(args.plan)
        overrides = plan_as_overrides(plan)
        spec_path = spec_path or (
            plan.provenance.spec if Path(plan.provenance.spec).exists() else None
        )
    overrides |= spec_overrides(args)
    spec = load_spec(spec_path, overrides=overrides)
    # the plan's model exactly: its vocabulary is not derived again from a tokenizer
    spec.model_pinned = bool(args.plan)
    result = optimize(spec)
    if spec.budget_conversion and not args.json:
        print(spec.budget_conversion)
    n = result.timings.get("candidates", len(result.table))
    what = (
        f"evaluated {n:,} configuration(s): "
        + ("the plan's own" if args.plan else "the spec's search space")
        + (" with the --set values pinned" if args.set else "")
        + " (no probes; the cost model only)"
    )
    if args.json:
        print(json.dumps(optimize_json(result, None) | {"evaluated": what}, indent=1))
    else:
        print(what)
        for line in spec.model_changes:  # every change to the asked model, one line each
            print(fit_lines(line))
        print(render_candidates(result, 5))
        print(render_model(result))
        print(render_choice(result))
        if args.memory:
            from planner.reporting.report import render_memory

            print(render_memory(result))
    return 0 if result.chosen is not None else 1


def plan_as_overrides(plan: Plan) -> dict:
    """Pin every searched dimension, and the model, to the plan's value."""
    import dataclasses

    from gptplan import families
    from gptplan.layout import Layout
    from gptplan.modelfacts import kv_heads
    from planner.spec import ModelSpec

    t, hw = plan.training, plan.hardware
    m = plan.model
    # every field the spec's [model] table sets besides the size's name, as the plan has it
    model = {
        f"model.{f.name}": getattr(m, f.name)
        for f in dataclasses.fields(ModelSpec)
        if f.name != "size"
    }
    # the size's name (for display) only where it cannot bring back KV heads the plan dropped
    named = families.all_sizes().get(m.name)
    keep_name = named is not None and kv_heads(m) == (
        named.num_key_value_heads or named.num_attention_heads
    )
    return {
        "model.size": m.name if keep_name else "",
        **model,
        # the plan's layout as spec pins (gptplan.layout: the one translation)
        **Layout.from_plan(plan).spec_pins(),
        "constraints.profiles": [hw.profile],
        "constraints.offers": [hw.offer],
        "constraints.global_batch_tokens_min": plan.tokens_per_step,
        "constraints.global_batch_tokens_max": plan.tokens_per_step,
        "constraints.spot": hw.spot,
        "constraints.on_demand": not hw.spot,
        "constraints.budget": 0.0,
        "constraints.deadline_hours": 0.0,
        "job.target_tokens": float(plan.job.target_tokens or plan.tokens_per_step * t.max_steps),
        "job.corpus": list(plan.job.corpus),
    }
