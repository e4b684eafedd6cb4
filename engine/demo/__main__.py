"""`python -m engine.demo [draft|copy]`: build the demo model (or its draft model, for
`--speculative-draft-model`, or its copy model, for bench/speculative.py's copy task) now,
unless it is cached; print its directory.

scripts/demo.sh runs it before starting the server, so that a person sees the one-time build
announced and its progress as plain lines on stderr ("demo model: step 300/1100, loss ...")
rather than as the server's log records.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.demo.checkpoint import SIZES, cached_demo_checkpoint, ensure_demo_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", nargs="?", default="demo", choices=SIZES)
    size = parser.parse_args(argv).size
    if cached_demo_checkpoint(size=size) is None:
        print(
            f"Training the {'demo' if size == 'demo' else f'demo {size}'} model (once, cached in "
            "~/.cache/sluice: a minute or a few on two idle CPU cores, several times that on a "
            "busy machine)...",
            file=sys.stderr,
            flush=True,
        )
        logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
    print(ensure_demo_checkpoint(size=size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
