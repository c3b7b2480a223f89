"""Tuning: measure candidates on real hardware and fold the measurements back in.

Owns the Optuna study (study), the probes and their backends behind one protocol (probes:
ProbeBackend and the live LocalProbe; replay: ReplayProbe, recorded measurements), the
autotuning loop (autotune), the noise model of a measurement (noise), the calibration fitted
from probes (calibration) and stopping on a signal or a bound (stopping).

May import: gptplan, runner.probe, planner.spec, planner.market, planner.corpus,
planner.screen and planner.writing (a probed candidate is probed as the plan it would write).
"""
