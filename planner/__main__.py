import sys

from planner.commands.main import entry

sys.exit(entry())
