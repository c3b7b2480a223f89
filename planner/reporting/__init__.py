"""Reporting: what a user reads. Candidate tables and records (report), costs and prices
(costreport), why a plan is what it is (explain), the Pareto plot (plots). Rendering only:
no choice is made here.

May import: gptplan, planner.spec, planner.market, planner.corpus, planner.screen,
planner.writing and planner.tuning (measured costs of probed rows).
"""
