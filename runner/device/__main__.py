"""`python -m runner.device build` (what `make setup` runs) and `python -m runner.device status`."""

from __future__ import annotations

import argparse
import json
import sys

from runner import device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.device", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="compile the rehearsal device against the installed Paddle")
    status = sub.add_parser(
        "status", help="whether the device is built and loadable, and what it runs"
    )
    status.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        try:
            device.build()
        except device.DeviceBuildError as exc:
            print(f"note: the rehearsal device was not built: {exc}", file=sys.stderr)
            print(
                "note: without it, `runner execute --local` rehearses data parallel and ZeRO-1 "
                "only; tensor, pipeline and sequence parallel and sharding stage 2/3 rehearsals "
                "are unavailable",
                file=sys.stderr,
            )
            return 1
        return 0
    caps = device.capabilities(check_load=True)
    if args.json:
        print(json.dumps(caps, indent=1))
    elif caps["available"]:
        print(f"rehearsal device {caps['device_type']}: available ({caps['root']})")
        layouts, precisions = ", ".join(caps["layout_kinds"]), ", ".join(caps["precisions"])
        print(f"  layouts: {layouts}; precisions: {precisions}")
    else:
        print(f"rehearsal device {caps['device_type']}: unavailable: {caps['reason']}")
    return 0 if caps["available"] else 1


if __name__ == "__main__":
    sys.exit(main())
