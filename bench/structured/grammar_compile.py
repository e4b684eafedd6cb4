"""What a grammar bomb costs the other callers, and what a normal constraint costs.

Starts `python -m service` (extra flags after `--`) on a tiny random Llama checkpoint and:
- small: sends `--small` distinct small JSON schemas one after another (a Generate of one
  token each: the constraint compiles at admission), timing each;
- bomb: sends a GBNF grammar of `--rules` rules (150 kB at 4,000, 35 s or more to compile on
  the tests' 320-token vocabulary: each rule a literal or any run of letters, then the next)
  on one connection and, `--delay` s later, a small schema on another; times both and records
  the bomb's status and the health status meanwhile.

    python -m bench.structured.grammar_compile -- --grammar-compile-timeout 10
    python -m bench.structured.grammar_compile --repo /path/to/other/checkout   # the same, another tree
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, machine, percentile

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=20, help="small schemas timed one by one")
    p.add_argument("--rules", type=int, default=4000, help="rules of the bomb grammar")
    p.add_argument("--delay", type=float, default=0.5, help="seconds from the bomb to the small")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server runs")
    p.add_argument("flags", nargs="*", help="`python -m service` flags (after --)")
    return p.parse_args(argv)


def small_schema(i: int) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {f"field{i}": {"type": "integer"}, "name": {"type": "string"}},
            "required": [f"field{i}"],
        }
    )


def wide_grammar(rules: int) -> str:
    """The bomb (as tests/support/grammar_bomb.py's): its compile time grows much faster than its size."""
    body = "".join(f'r{i} ::= "w{i}" r{i + 1} | [a-z]* r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "."\n'


async def generate(target: str, **structured: str) -> tuple[float, str]:
    """Seconds a one-token Generate constrained by `structured` (a StructuredOutput's field)
    took, on a connection of its own,
    and its status name."""
    import grpc
    from sluice.v1 import generation_pb2 as pb
    from sluice_client import AsyncClient, build_request

    request = build_request([0, 5, 7], max_tokens=1)
    request.structured.CopyFrom(pb.StructuredOutput(**structured))
    start = time.perf_counter()
    # NOTE: a connection of its own: channels to one target share one by default, and the
    # server shares compiles out by connection.
    channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    async with AsyncClient(target, channel=channel) as client:
        try:
            await client.complete(request)
            status = "OK"
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
    return time.perf_counter() - start, status


async def measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    small = [(await generate(target, json_schema=small_schema(i)))[0] for i in range(args.small)]
    bomb = asyncio.create_task(generate(target, grammar=wide_grammar(args.rules)))
    await asyncio.sleep(args.delay)
    after, after_status = await generate(target, json_schema=small_schema(-1))
    bomb_s, bomb_status = await bomb
    ms = [1e3 * s for s in small[1:]]  # the first one starts the compile workers
    return {
        "first_small_ms": 1e3 * small[0],
        "small_ms_p50": percentile(ms, 50),
        "small_ms_max": max(ms),
        "bomb_s": bomb_s,
        "bomb_status": bomb_status,
        "small_after_bomb_s": after,
        "small_after_bomb_status": after_status,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(args.repo))
    from tests.support.server_process import server_process
    from tests.support.tiny_models import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="sluice-grammar-") as tmp:
        model = make_checkpoint(Path(tmp) / "model", "llama")
        flags = ["--model", str(model), "--device", "cpu", "--dtype", "float32", *args.flags]
        with server_process(Path(tmp) / "server.log", *flags) as server:
            server.wait_health("SERVING", timeout=300)
            run = asyncio.run(measure(server.target, args))
    result = {"benchmark": "grammar_compile", "settings": {**vars(args), "repo": str(args.repo)}}
    result |= {"run": run, "machine": machine()}
    emit(result, list(run), [list(run.values())])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
