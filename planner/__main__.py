import sys

from planner.commands.main import main

sys.exit(main())
