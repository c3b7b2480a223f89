"""The screen: every candidate configuration modelled and priced, and the choice among them.

Owns the candidate space (space), the columnar table (table), evaluation with the cost model
(evaluate, costmodel), pricing per capacity (pricing), a row's memory in words (memory), the
decision (decide), the plan's risks (risk), the largest model or corpus a budget buys
(maximize), the fit to published runs and where a query lies outside them (published,
coverage).

May import: gptplan, planner.spec, planner.market and planner.corpus.
"""
