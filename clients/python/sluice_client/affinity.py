"""The routing key a load balancer in front of several Sluice replicas hashes (docs/deploy.md).

A call that carries `x-sluice-affinity: <key>` (a conversation or rollout-group id) lands on the
replica its key hashes to, where the prompts it shares with earlier calls of the same key are
in the prefix cache; a call without one goes wherever the balancer likes. A Sluice server itself
ignores the key: it matters only to the balancer.
"""

from __future__ import annotations

from collections.abc import Sequence

AFFINITY_KEY = "x-sluice-affinity"
# A key travels as an HTTP/2 header value, which the balancer hashes: keep it short and plain.
MAX_AFFINITY_CHARS = 256

Metadata = tuple[tuple[str, str], ...]


def with_affinity(metadata: Sequence[tuple[str, str]], affinity: str | None) -> Metadata:
    """`metadata` plus the routing key (none when `affinity` is None or empty).

    Raises ValueError for a key that is not 1 to MAX_AFFINITY_CHARS printable ASCII characters
    without spaces (what every balancer passes through and hashes unchanged)."""
    if affinity is None or affinity == "":
        return tuple(metadata)
    if len(affinity) > MAX_AFFINITY_CHARS or not all("!" <= c <= "~" for c in affinity):
        raise ValueError(
            f"affinity: {affinity[:40]!r} must be printable ASCII without spaces, at most "
            f"{MAX_AFFINITY_CHARS} characters"
        )
    return (*metadata, (AFFINITY_KEY, affinity))
