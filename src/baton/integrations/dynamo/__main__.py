"""``python -m baton.integrations.dynamo``: parse the flags, set Dynamo's environment, then
load Dynamo and run its ``Worker`` over ``BatonLLMEngine``."""

from __future__ import annotations

import logging
import os
import sys

from baton.integrations.dynamo.args import ADVERTISED, build_parser


def main(argv: list[str] | None = None) -> None:
    from baton.server.http import configure_logging

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # --help and bad flags here, before Dynamo loads
    configure_logging(args.role, args.log_level, args.access_log)
    # NOTE: written for Dynamo's runtime, which reads them when it loads (below). A quiet
    # console: at info it logs two lines per request; a DYN_LOG given wins.
    os.environ.setdefault("DYN_LOG", "debug" if args.log_level == "debug" else "warn")
    if args.advertise_host:
        os.environ.update(dict.fromkeys(ADVERTISED, args.advertise_host))
    if args.access_log:  # its own handler: Dynamo's runtime sets the root's level from DYN_LOG
        logger = logging.getLogger("baton.dynamo")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    from dynamo.common.backend.run import run

    from baton.integrations.dynamo.worker import BatonLLMEngine

    run(BatonLLMEngine, argv)


if __name__ == "__main__":
    main()
