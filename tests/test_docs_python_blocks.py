"""Every ```python block of the README and docs/ is Python that runs as pasted.

Each block compiles as a module (a top-level `await` or `async with`, which only a notebook
accepts, is a SyntaxError here). Those that call a server at 127.0.0.1:50051 also run, as their
own program, against a server on the fake engine and a tokenizer with a chat template; the
blocks that need what a test cannot give them (a checkpoint directory, an adapter on disk, an
admin token file, a trainer's process group, another package) are named in NEEDS with why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support.service_harness import running_server
from tests.support.tiny_models import write_chat_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
DOC_TARGET = "127.0.0.1:50051"

# A phrase of a block -> why the block does not run here (it still compiles).
NEEDS = {
    "admin.token": "an admin token file and an adapter directory on disk",
    'admin_token="..."': "an admin token and a checkpoint directory to load",
    "json_schema=": "the real engine: the fake one does not follow a constraint to its end",
    "/path/to/": "a checkpoint directory",
    "get_peft_model_state_dict": "peft and a trainer's model",
    "WeightTransfer": "a trainer's torch.distributed process group",
    "read_safetensors": "a checkpoint to send",
    "client.sleep(": "an admin client named `client` from an earlier block",
    "c = client.complete(": "a `client` from an earlier block",
    "scored = client.complete(": "a `client` from an earlier block",
    "tls=TlsConfig(": "TLS certificates",
    "ssl_channel_credentials": "TLS certificates",
}


def blocks() -> list[tuple[str, str]]:
    """(file:line, source) of every python block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return found


def runnable(source: str) -> bool:
    return DOC_TARGET in source and not any(phrase in source for phrase in NEEDS)


ALL = blocks()
RUNNABLE = [(name, source) for name, source in ALL if runnable(source)]


@pytest.mark.parametrize(("name", "source"), ALL, ids=[name for name, _ in ALL])
def test_the_block_compiles_as_a_module(name: str, source: str) -> None:
    compile(source, name, "exec")


def test_the_blocks_that_call_a_server_are_found() -> None:
    names = [name for name, _ in RUNNABLE]
    assert any(n.startswith("README.md") for n in names), names
    assert sum(n.startswith("docs/clients.md") for n in names) >= 3, names


def test_a_top_level_await_is_caught() -> None:
    with pytest.raises(SyntaxError):
        compile("async with x as y:\n    pass\n", "snippet", "exec")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("docs-model")
    write_chat_tokenizer(directory, "qwen2_5")
    (directory / "fake.json").write_text('{"vocab_size": 400, "max_model_len": 2048}')
    async with running_server(directory) as (_, address):
        yield address


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("name", "source"), RUNNABLE, ids=[name for name, _ in RUNNABLE])
async def test_the_block_runs_against_a_server(name: str, source: str, target: str) -> None:
    import asyncio

    program = source.replace(DOC_TARGET, target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", program],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, f"{name}:\n{run.stderr}"
