"""A live Sluice server on tiny random checkpoints, for the clients' tests (the Node client's,
and scripts/check_client_package.sh's client-only install).

Writes checkpoint A (served) and checkpoint B (same shapes, other weights) into a temp dir,
starts `python -m service` on A with an API token, an admin token and any extra flags given
here, waits until it is SERVING, then prints one JSON line: {"target", "checkpointA",
"checkpointB", "tensorsA" (A's .safetensors file), "apiToken", "adminToken"}. Runs until stdin closes or SIGTERM, then
stops the server and removes the temp dir.

Usage: python tests/support/serve_tiny.py [extra `sluice serve` flags]
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from tests.support.server_process import server_process  # noqa: E402
from tests.support.tiny_models import make_checkpoint  # noqa: E402

API_TOKEN = "tiny-test-api"
ADMIN_TOKEN = "tiny-test-admin"


# A small template on the tiny tokenizer's own <s> and </s>, for the clients' chat tests.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _add_chat_template(checkpoint: Path) -> None:
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))


def main(extra_flags: list[str]) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="sluice-tiny-") as tmp:
        root = Path(tmp)
        checkpoint_a = make_checkpoint(root / "a", "llama", seed=0)
        _add_chat_template(checkpoint_a)
        checkpoint_b = make_checkpoint(root / "b", "llama", seed=1)
        (root / "api-token").write_text(API_TOKEN)
        (root / "admin-token").write_text(ADMIN_TOKEN)
        flags = ["--model", str(checkpoint_a), "--device", "cpu", "--dtype", "float32"]
        flags += ["--api-token-file", str(root / "api-token")]
        flags += ["--admin-token-file", str(root / "admin-token"), *extra_flags]
        with server_process(root / "server.log", *flags) as server:
            server.wait_health("SERVING")
            ready = {
                "target": server.target,
                "checkpointA": str(checkpoint_a),
                "checkpointB": str(checkpoint_b),
                "tensorsA": str(checkpoint_a / "model.safetensors"),
                "apiToken": API_TOKEN,
                "adminToken": ADMIN_TOKEN,
            }
            print(json.dumps(ready), flush=True)
            # The parent closing our stdin (or dying) is the signal to stop.
            threading.Thread(target=_wait_stdin_closed, args=(stop,), daemon=True).start()
            stop.wait()
    return 0


def _wait_stdin_closed(stop: threading.Event) -> None:
    sys.stdin.read()
    stop.set()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
