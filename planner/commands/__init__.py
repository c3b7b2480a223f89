"""The `planner` command line: argument parsing and dispatch only, one module per command.
`planner.commands.main` builds the parser and dispatches; `flags` and `overrides` hold the
options several commands share. The work is done by the packages below.

May import: everything in planner (and gptplan, runner.probe through planner.tuning).
"""
