"""Writing: a chosen candidate as a plan file (planwriter) and the plan as a SkyPilot task
(skypilot).

May import: gptplan, planner (the version), planner.spec, planner.market, planner.corpus and
planner.screen.
"""
