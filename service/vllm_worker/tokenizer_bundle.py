"""TokenizerBundle: the checkpoint's tokenizer files as the zip GetTokenizer streams.

The gateway builds its tokenizer and chat template from this archive instead of a local copy
of the model. Its layout is the vLLM servicer's: the files at the zip's root under their own
names, chosen from the checkpoint directory by name (tokenizer, its config, the model and
generation configs, chat templates, SentencePiece and tiktoken files). Weights are never
included: no name or pattern below matches a weight file. A server started with
--chat-template sends that template as chat_template.jinja, so the gateway renders chats as
Sluice does.

Built once, in a worker thread (reading and deflating is file I/O and CPU the event loop must
not wait for), and served from memory after that: the checkpoint directory does not change
while the server runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from service.vllm_worker.pb import common_pb2

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk, as the vLLM servicer sends them
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "chat_template.jinja",
)
PATTERNS = ("*.tiktoken", "*.jinja", "*.model")
CHAT_TEMPLATE_NAME = "chat_template.jinja"


class TokenizerBundle:
    """The archive of one checkpoint directory, and its SHA-256 (hex)."""

    def __init__(self, directory: Path, chat_template: Path | None = None) -> None:
        self.directory = directory
        self.chat_template = chat_template  # the server's --chat-template, if any
        self._archive: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        """The zip's bytes and their SHA-256 hex digest; raises FileNotFoundError when the
        directory holds no tokenizer file."""
        async with self._lock:  # callers during the build share it
            if self._archive is None:
                self._archive = await asyncio.to_thread(self._build)
            return self._archive

    def _build(self) -> tuple[bytes, str]:
        files: dict[str, Path] = {}
        for name in FILES:
            if (self.directory / name).is_file():
                files[name] = self.directory / name
        for pattern in PATTERNS:
            for path in sorted(self.directory.glob(pattern)):
                if path.is_file():
                    files.setdefault(path.name, path)
        if self.chat_template is not None:
            files[CHAT_TEMPLATE_NAME] = self.chat_template
        if not files:
            raise FileNotFoundError(f"no tokenizer file in {self.directory}")
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, path in files.items():
                archive.write(path, name)
        data = buffer.getvalue()
        return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """`data` in GetTokenizerChunk messages of at most CHUNK_BYTES; the last one carries the
    SHA-256 of the whole archive, the others an empty one."""
    for offset in range(0, len(data), CHUNK_BYTES):
        end = min(offset + CHUNK_BYTES, len(data))
        yield common_pb2.GetTokenizerChunk(
            data=data[offset:end], sha256=sha256 if end == len(data) else ""
        )
