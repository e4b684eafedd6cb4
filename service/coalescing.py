"""coalesce: merge the token chunks of one sample that wait together into one message.

Under load the service sends fewer, larger messages: each message costs far more CPU in the
gRPC stack than one more token inside it. Events pile up only while the stream's previous
message is being written, so an idle stream still sends each token alone, at once.
"""

from __future__ import annotations

from sluice.v1 import generation_pb2 as pb


def coalesce(events: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """`events` with each TokenChunk merged into the previous chunk of the same sample
    (request id and index) when nothing else of that sample came between them and both carry
    the same policy version (a chunk never mixes versions). Merging appends token ids, text,
    logprobs and top logprobs in order, so every sample sees the same tokens, the same text
    and the same order of events; only the chunk boundaries change. The merged-into events
    are modified in place."""
    merged: list[pb.GenerateResponse] = []
    open_chunks: dict[tuple[str, int], pb.TokenChunk] = {}  # a sample's last event, a chunk
    for event in events:
        key = (event.request_id, event.index)
        if event.WhichOneof("event") != "tokens":
            open_chunks.pop(key, None)
            merged.append(event)
            continue
        chunk = event.tokens
        into = open_chunks.get(key)
        if into is not None and into.policy_version == chunk.policy_version:
            into.token_ids.extend(chunk.token_ids)
            into.text += chunk.text
            into.logprobs.extend(chunk.logprobs)
            into.top_logprobs.extend(chunk.top_logprobs)
            continue
        open_chunks[key] = chunk
        merged.append(event)
    return merged
