"""Greedy completions from the Python client, for comparison with the Node client's.

Usage: python python_greedy.py TARGET API_TOKEN < {"prompts": [str | [int]], "maxTokens": int}
Prints a JSON list: the token ids of each prompt's completion.
"""

from __future__ import annotations

import json
import sys

from sluice_client import Client


def main(target: str, api_token: str) -> None:
    job = json.load(sys.stdin)
    with Client(target, api_token=api_token) as client:
        ids = [
            client.complete(
                prompt, max_tokens=job["maxTokens"], temperature=0.0, ignore_eos=True
            ).token_ids
            for prompt in job["prompts"]
        ]
    json.dump(ids, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:3])
