"""planner: choose the cheapest way to pretrain a GPT with PaddlePaddle, write it as a plan.

By concern, lowest first (each subpackage imports only those before it; the structure test
holds it, tests/test_planner_structure.py):

- spec: the job spec schema (planner.spec)
- market: hardware profiles, offers, prices, spot risk
- corpus: corpus statistics and the data-preparation estimate
- screen: the candidate space, table, evaluation, pricing and decision
- writing: the plan file and the SkyPilot task
- tuning: probes, the study, noise, calibration, stopping
- reporting: tables, costs, explain, plots
- pipeline: the optimize flow that ties them together (planner.pipeline)
- commands: the command line, parsing and dispatch only
"""

__version__ = "0.1.0"
