"""`python -m engine.demo`: build the demo model now, unless it is cached; print its directory.

scripts/demo.sh runs it before starting the server, so that a person sees the one-time build
announced and its progress as plain lines on stderr ("demo model: step 300/1100, loss ...")
rather than as the server's log records.
"""

from __future__ import annotations

import logging
import sys

from engine.demo.checkpoint import cached_demo_checkpoint, ensure_demo_checkpoint


def main() -> int:
    if cached_demo_checkpoint() is None:
        print(
            "Training the demo model (once, cached in ~/.cache/sluice: about a minute on two "
            "idle CPU cores, several on a busy machine)...",
            file=sys.stderr,
            flush=True,
        )
        logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
    print(ensure_demo_checkpoint())
    return 0


if __name__ == "__main__":
    sys.exit(main())
