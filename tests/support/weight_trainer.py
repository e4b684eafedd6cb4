"""A trainer process for weight-transfer tests: joins a server's engine with
sluice_client.weight_transfer and pushes tensors, step by step, as its JSON argument says.

    python tests/support/weight_trainer.py '{"target": ..., "admin_token": ..., "steps": [...]}'

Each step pushes a safetensors file's tensors (`weights`), optionally altered (`reshape`:
a name whose shape becomes [3, 3]; `bf16`: a name sent as bfloat16), at `policy_version`
with `inflight`; `die_after_buckets` n: the process exits (status 3) as the bucket after the
n-th is due, mid-broadcast. One JSON line per step on stdout: {"ok": true, "policy_version"}
or {"ok": false, "code", "message"}, with the events seen ("paused", "loading", "applied").
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import grpc
import torch
from safetensors.torch import load_file
from sluice_client.weight_transfer import WeightTransfer

DIED = 3


class DieAfter:
    """Stands in for the trainer's process group: exits the process at broadcast n + 1."""

    def __init__(self, group: Any, buckets: int) -> None:
        self.group, self.left = group, buckets

    def broadcast(self, buffer: torch.Tensor, root: int) -> Any:
        if self.left == 0:
            sys.stdout.flush()
            os._exit(DIED)
        self.left -= 1
        return self.group.broadcast(buffer, root)


def run_step(transfer: WeightTransfer, step: dict[str, Any]) -> dict[str, Any]:
    tensors = load_file(step["weights"])
    if "reshape" in step:
        tensors[step["reshape"]] = torch.zeros(3, 3)
    if "bf16" in step:
        tensors[step["bf16"]] = tensors[step["bf16"]].to(torch.bfloat16)
    if "die_after_buckets" in step:
        group = transfer._group
        assert group is not None
        group._group = DieAfter(group._group, step["die_after_buckets"])
    seen: list[str] = []
    try:
        applied = transfer.push(
            tensors,
            policy_version=step.get("policy_version", 0),
            inflight=step.get("inflight", "continue"),
            on_progress=lambda event: seen.append(str(event.WhichOneof("event"))),
        )
    except grpc.RpcError as exc:
        return {"ok": False, "code": exc.code().name, "message": exc.details(), "events": seen}
    return {"ok": True, "policy_version": applied.policy_version, "events": seen}


def main() -> None:
    spec = json.loads(sys.argv[1])
    with WeightTransfer(
        spec["target"],
        admin_token=spec["admin_token"],
        timeout=spec.get("timeout", 30.0),
        bucket_bytes=spec.get("bucket_bytes", 1 << 30),
        engine_ranks=spec.get("engine_ranks"),  # None: asked of the server
    ) as transfer:
        for step in spec["steps"]:
            print(json.dumps(run_step(transfer, step)), flush=True)


if __name__ == "__main__":
    main()
