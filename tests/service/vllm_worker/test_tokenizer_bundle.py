"""TokenizerBundle on its own: the server's --chat-template travels as chat_template.jinja, and
files that are not the tokenizer's (weights among them) never do."""

from __future__ import annotations

import hashlib
import io
import random
import zipfile
from pathlib import Path

import pytest

from service.vllm_worker.tokenizer_bundle import CHUNK_BYTES, TokenizerBundle, chunks
from tests.support.tiny_models import make_tokenizer

pytestmark = pytest.mark.asyncio


def checkpoint(directory: Path) -> Path:
    directory.mkdir()
    make_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    (directory / "model.safetensors").write_bytes(b"\0" * 1024)
    (directory / "pytorch_model.bin").write_bytes(b"\0" * 1024)
    (directory / "notes.txt").write_text("not a tokenizer file")
    return directory


async def test_the_servers_chat_template_replaces_the_checkpoints(tmp_path) -> None:
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    data, sha256 = await TokenizerBundle(checkpoint(tmp_path / "model"), override).archive()
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        assert sorted(bundle.namelist()) == ["chat_template.jinja", "tokenizer.json"]
        assert bundle.read("chat_template.jinja") == override.read_bytes()
    assert sha256 == hashlib.sha256(data).hexdigest()


async def test_chunks_split_the_archive_and_the_last_carries_the_checksum() -> None:
    data = random.Random(0).randbytes(2 * CHUNK_BYTES + 100)  # as an archive over 64 KiB
    sha256 = hashlib.sha256(data).hexdigest()
    sent = list(chunks(data, sha256))
    assert [len(c.data) for c in sent] == [CHUNK_BYTES, CHUNK_BYTES, 100]
    assert b"".join(c.data for c in sent) == data
    assert [c.sha256 for c in sent] == [""] * (len(sent) - 1) + [sha256]


async def test_a_directory_without_tokenizer_files_is_an_error(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        await TokenizerBundle(tmp_path / "empty").archive()
