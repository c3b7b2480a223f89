"""Script that `paddle.distributed.launch` starts in each worker process.

launch wants a script path; running a module of the package as a script would put runner/ on
sys.path and let its module names shadow others, so this file removes its own folder first.
"""

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)


if __name__ == "__main__":
    from gptplan.lifeline import set_parent_death_signal
    from runner.supervise import supervise

    supervise()  # the rank runs in a forked child; memory limit, peak RSS and exit status
    set_parent_death_signal()  # the launcher dies (SIGKILL): this worker goes too
    from gptplan import paddlenlp_light, quiet_third_party_warnings

    quiet_third_party_warnings()
    paddlenlp_light.enable()  # PaddleNLP's models without the rest of it (gptplan.paddlenlp_light)
    if sys.argv[1:2] == ["probe"]:
        from runner.probe import probe_main

        sys.exit(probe_main(sys.argv[2:]))
    from runner.train import worker_main

    sys.exit(worker_main())
