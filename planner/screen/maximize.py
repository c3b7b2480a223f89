"""`planner optimize --maximize tokens|params`: what the budget buys within the deadline.

- **tokens**: the most training tokens of the spec's model whose cheapest plan (memory,
  deadline, price rules) costs at most the budget (modelled). Found by re-planning: the first
  search at the spec's target gives, per plan, the share of that target the budget and the
  deadline allow (`planner.screen.decide.tokens_within`); the space is then searched again at that
  many tokens, and again, until the chosen plan's cost is within 0.5% of what the limits allow
  (at most `MAX_ROUNDS` searches).
- **params**: the largest named size of the spec's family (`gptplan.modelfacts.MODEL_SIZES`)
  that can be trained on `tokens_per_param` tokens per parameter (default 20: Hoffmann et al.
  2022, "Training Compute-Optimal Large Language Models") within budget and deadline.

Both say the probability that the run stays within the budget, from the chosen plan's cost
interval: the modelled cost as the median and p10/p90 as the 10th/90th percentiles of a
two-piece log-normal (`probability_within`), and the tokens for which the plan's p90 cost meets
the budget (about 90% probability).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gptplan import families
from gptplan.errors import UserError
from planner.screen.risk import Z90, probability_within, row_risk  # noqa: F401 (re-exported)

MAX_ROUNDS = 8
TOLERANCE = 0.005  # stop when the chosen plan spends within 0.5% of what the limits allow
# aim this far under the linear estimate: whole optimizer steps round the tokens up
UNDERSHOOT = 0.001
TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022 (Chinchilla): about 20 tokens per parameter


@dataclass
class Maximum:
    """The answer of --maximize: the target to plan for, and what it costs."""

    maximize: str  # "tokens" or "params"
    target_tokens: float
    model_size: str
    model_parameters: float
    tokens_per_param: float  # the ratio used (params), or target / parameters (tokens)
    cost: float
    cost_p10: float
    cost_p90: float
    hours: float
    hours_p10: float
    hours_p90: float
    probability_within_budget: float
    tokens_p90_within_budget: float  # tokens at which the p90 cost meets the budget
    budget: float
    deadline_hours: float
    currency: str
    searches: int
    binding: str  # what stops more: "budget", "deadline" or "both"
    tried: list[dict] = dataclasses.field(default_factory=list)  # params: each size tried
    probability_meeting_deadline: float = 1.0  # from the same hours interval (planner.screen.risk)
    spot_gpu_hours: float = 0.0
    capacity_bet: str = (
        ""  # planner.screen.risk's bet line ('' = not a bet, fallback within budget)
    )

    def lines(self) -> list[str]:
        cur = self.currency
        what = (
            f"the most tokens {self.budget:,.0f} {cur} buys"
            if self.maximize == "tokens"
            else (
                f"the largest {self.model_size.split('-')[0]} model {self.budget:,.0f} {cur} "
                f"trains at {self.tokens_per_param:g} tokens per parameter"
            )
        )
        within = f" within {self.deadline_hours:g} h" if self.deadline_hours else ""
        out = [
            f"maximize {self.maximize}: {what}{within} (modelled): "
            f"{self.model_size} ({self.model_parameters / 1e9:.3g}B parameters), "
            f"{self.target_tokens:.3g} tokens",
            f"  P(within budget) = {self.probability_within_budget:.0%}, "
            + (
                f"P(meeting the {self.deadline_hours:,.0f} h deadline) = "
                f"{self.probability_meeting_deadline:.0%}"
                if self.deadline_hours
                else "no deadline set"
            )
            + " (modelled, from the plan's 80% cost and hours intervals)",
            *([f"  {self.capacity_bet}"] if self.capacity_bet else []),
            f"  cost {self.cost:,.0f} {cur} (p10-p90 {self.cost_p10:,.0f}-{self.cost_p90:,.0f}), "
            f"{self.hours:,.3g} h (p10-p90 {self.hours_p10:,.3g}-{self.hours_p90:,.3g})",
            f"  with 90% probability within budget: {self.tokens_p90_within_budget:.3g} tokens "
            f"(where the p90 cost meets the budget); limited by the {self.binding}; "
            f"{self.searches} search(es) of the space"
            if self.maximize == "tokens"
            else f"  limited by the {self.binding}; {self.searches} search(es) of the space",
        ]
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _spec_with(spec, *, target: float, size: str | None = None):
    job = dataclasses.replace(spec.job, target_tokens=float(target), epochs=0.0)
    if size is None:
        return dataclasses.replace(spec, job=job)
    # the named size's shape, not the spec's overrides (0 / False = keep the size's)
    keep = {name: type(getattr(spec.model, name))() for name in families.SHAPE_FIELDS}
    keep |= {
        name: type(getattr(spec.model, name))()
        for name in families.OPTIONAL_FIELDS
        if name != "tie_word_embeddings"
    }
    model = dataclasses.replace(spec.model, size=size, **keep)
    # each size keeps its own vocabulary, unless the run's own tokenizer set another one
    # (planner.pipeline.set_planned_vocab)
    changed = spec.planned_vocab_size and spec.planned_vocab_size != spec.asked_vocab_size()
    vocab = spec.planned_vocab_size if changed else 0
    return dataclasses.replace(spec, job=job, model=model, planned_vocab_size=vocab)


def _search(spec, offers, target):
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space

    table = evaluate_space(spec, offers, target)
    return table, decide(spec, table, target)


def _binding(spec, table, i) -> str:
    c = spec.constraints
    by_budget = c.budget and table["cost"][i] >= 0.98 * c.budget
    by_deadline = c.deadline_hours and table["hours"][i] >= 0.98 * c.deadline_hours
    return (
        "budget and deadline"
        if by_budget and by_deadline
        else ("deadline" if by_deadline and not by_budget else "budget")
    )


def most_tokens(spec, offers, start: float):
    """(target, table, decision, searches): the most tokens whose cheapest plan meets every
    constraint, by re-planning at what the limits allow (see the module's docstring)."""
    from planner.screen.decide import tokens_within

    target = float(start)
    best = None
    low, high = 0.0, math.inf
    searches = 0
    for _ in range(MAX_ROUNDS):
        table, decision = _search(spec, offers, target)
        searches += 1
        allowed = tokens_within(spec, table, target)
        if not allowed:
            break
        if decision.chosen is not None:
            low = max(low, target)
            if best is None or target >= best[0]:
                best = (target, table, decision)
            if allowed <= target * (1 + TOLERANCE):
                break  # the chosen plan already spends what the limits allow
            nxt = allowed * (1 - UNDERSHOOT)
        else:
            high = min(high, target)
            nxt = min(allowed * (1 - UNDERSHOOT), target * (1 - TOLERANCE))
        if not low < nxt < high:  # the linear step left the bracket: bisect it
            nxt = (low + high) / 2
        if math.isfinite(high) and high - low < TOLERANCE * high:
            break
        target = nxt
    if best is None:
        return None
    return (*best, searches)


def _next_size(tried: list[dict], currency: str) -> str:
    """Why the next larger size was not chosen (params mode)."""
    last = tried[-1] if tried else {}
    if last.get("fits", True):
        return "largest size of the family"
    if last.get("minimum_budget"):
        return (
            f"budget: the next size, {last['model_size']}, needs at least "
            f"{last['minimum_budget']:,.0f} {currency} (modelled)"
        )
    return f"deadline or memory: the next size, {last['model_size']}, has no plan"


def _params(spec) -> float:
    from planner.screen import costmodel as cm

    return float(cm.ModelShape.from_section(spec.model_section()).params_total)


def maximize(spec, stats, *, what: str, tokens_per_param: float = TOKENS_PER_PARAM, log=print):
    """The target (and, for params, the model size) to plan for: (spec to plan, Maximum), or
    (None, message) when the budget buys nothing within the deadline."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.space import target_tokens

    c = spec.constraints
    if not c.budget:
        raise UserError(
            f"--maximize {what} needs a budget: set constraints.budget or --budget",
            file=spec.path,
            key="constraints.budget",
        )
    offers = allowed_offers(spec, load_profiles())
    tried: list[dict] = []
    if what == "tokens":
        found = most_tokens(spec, offers, target_tokens(spec, stats))
        if found is None:
            return None, "the budget buys no tokens within the deadline (modelled)"
        target, table, decision, searches = found
        planned = _spec_with(spec, target=target)
    else:
        family = families.get(spec.model_section().family)
        sizes = sorted((_params(_spec_with(spec, target=1, size=n)), n) for n in family.sizes)
        best = None
        searches = 0
        for params, name in sizes:
            candidate = _spec_with(spec, target=tokens_per_param * params, size=name)
            table, decision = _search(candidate, offers, tokens_per_param * params)
            searches += 1
            ok = decision.chosen is not None
            row = {"model_size": name, "model_parameters": params, "fits": ok}
            if ok:
                i = decision.chosen
                row |= {"cost": float(table["cost"][i]), "hours": float(table["hours"][i])}
            else:
                row["minimum_budget"] = decision.minimum_budget
                row["problems"] = decision.problems
            tried.append(row)
            if not ok:
                break  # a larger model of the family costs more
            best = (candidate, table, decision, params)
        if best is None:
            return None, (
                f"no {family} size trains at {tokens_per_param:g} tokens per parameter within "
                "budget and deadline (modelled)"
            )
        planned, table, decision, _ = best
        target = planned.job.target_tokens
    i = int(decision.chosen)
    row = table.row(i)
    cost, p10, p90 = (float(row[k]) for k in ("cost", "cost_p10", "cost_p90"))
    model = planned.model_section()
    params = _params(planned)
    risk = row_risk(planned, table, i)
    answer = Maximum(
        maximize=what,
        target_tokens=float(target),
        model_size=model.name,
        model_parameters=params,
        tokens_per_param=tokens_per_param if what == "params" else float(target) / params,
        cost=cost,
        cost_p10=p10,
        cost_p90=p90,
        hours=float(row["hours"]),
        hours_p10=float(row["hours_p10"]),
        hours_p90=float(row["hours_p90"]),
        probability_within_budget=probability_within(cost, p10, p90, c.budget),
        tokens_p90_within_budget=float(target) * min(1.0, c.budget / p90) if p90 else target,
        budget=c.budget,
        deadline_hours=c.deadline_hours,
        currency=c.currency,
        searches=searches,
        binding=_binding(spec, table, i) if what == "tokens" else _next_size(tried, c.currency),
        tried=tried,
        probability_meeting_deadline=risk.probability_meeting_deadline,
        spot_gpu_hours=risk.spot_gpu_hours,
        capacity_bet=risk.bet_line(budget=c.budget, currency=c.currency),
    )
    return planned, answer
