"""The demo checkpoint: a plain Hugging Face checkpoint, built once, the same bytes every time.

Builds use a couple of training steps so the whole file runs in seconds; the full recipe differs
only in its step count.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from engine.attention.torch_ref import TorchRefAttention
from engine.demo import checkpoint as demo
from engine.demo.checkpoint import ensure_demo_checkpoint
from engine.models.hf_config import load_model_config
from engine.models.llama import LlamaForCausalLM
from engine.weights.loading import load_weights
from tests.support.tiny_models import load_hf_model

STEPS = 2
HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Two OpenMP threads on a busy 2-core machine run these tiny steps 20x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("cache"), train_steps=STEPS)


def load_ours(directory: Path) -> LlamaForCausalLM:
    cfg = load_model_config(directory)
    model = LlamaForCausalLM(cfg, TorchRefAttention(scale=cfg.head_dim**-0.5))
    load_weights(model, directory)  # every tensor by its checkpoint name, none left over
    return model.eval()


def test_demo_directory_holds_a_hugging_face_checkpoint(demo_dir: Path) -> None:
    assert all((demo_dir / name).is_file() for name in HF_FILES)
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    eos = json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"]
    assert eos == tokenizer.token_to_id("</s>") == config["eos_token_id"]
    encoding = tokenizer.encode("The café")
    assert encoding.ids[0] == tokenizer.token_to_id("<s>")
    assert tokenizer.decode(encoding.ids) == "The café"
    assert tokenizer.get_vocab_size() == config["vocab_size"]


def test_transformers_loads_the_demo_checkpoint_with_our_logits(demo_dir: Path) -> None:
    ids = torch.tensor([Tokenizer.from_file(str(demo_dir / "tokenizer.json")).encode("The ").ids])
    ids = torch.cat([ids, torch.arange(20).view(1, -1)], dim=1)
    with torch.no_grad():
        ours = load_ours(demo_dir).dense_forward(ids)
        theirs = load_hf_model(demo_dir)(ids).logits
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)


def test_the_saved_tensors_have_the_hugging_face_names_and_shapes(demo_dir: Path) -> None:
    saved = load_file(str(demo_dir / "model.safetensors"))  # q/k/v and gate/up apart
    hf = {name: t.shape for name, t in load_hf_model(demo_dir).state_dict().items()}
    del hf["lm_head.weight"]  # tied to the embedding: not saved
    assert {name: t.shape for name, t in saved.items()} == hf


def test_second_call_returns_the_directory_without_rebuilding(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("rebuilt an existing demo checkpoint")

    monkeypatch.setattr(demo, "build_demo_checkpoint", fail)
    assert ensure_demo_checkpoint(demo_dir.parent, train_steps=STEPS) == demo_dir


def test_cached_demo_checkpoint_names_a_built_directory_and_builds_nothing(
    demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "RECIPE", dataclasses.replace(demo.RECIPE, steps=STEPS))
    assert demo.cached_demo_checkpoint(demo_dir.parent) == demo_dir
    assert demo.cached_demo_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_same_recipe_builds_identical_bytes(demo_dir: Path, tmp_path: Path) -> None:
    again = ensure_demo_checkpoint(tmp_path, train_steps=STEPS)
    assert again.name == demo_dir.name
    for name in HF_FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_the_draft_size_shares_the_demo_tokenizer_at_half_the_width_and_depth(
    demo_dir: Path,
) -> None:
    draft_dir = ensure_demo_checkpoint(demo_dir.parent, train_steps=STEPS, size="draft")
    assert draft_dir.name.startswith("demo-draft-") and draft_dir.parent == demo_dir.parent
    assert all((draft_dir / name).is_file() for name in HF_FILES)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name
    target, draft = (load_model_config(d) for d in (demo_dir, draft_dir))
    assert draft.vocab_size == target.vocab_size
    assert (draft.num_layers, draft.hidden_size) == (
        target.num_layers // 2,
        target.hidden_size // 2,
    )
    ids = torch.tensor([Tokenizer.from_file(str(draft_dir / "tokenizer.json")).encode("The ").ids])
    with torch.no_grad():  # every tensor loads by its checkpoint name; transformers agrees
        ours = load_ours(draft_dir).dense_forward(ids)
        theirs = load_hf_model(draft_dir)(ids).logits
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="size"):
        demo.cached_demo_checkpoint(demo_dir.parent, size="tiny")


def test_changed_recipe_gets_another_directory() -> None:
    corpus, template = demo.load_corpus(), demo.load_chat_template()
    fingerprint = demo.RECIPE.fingerprint(corpus, template)
    changed = dataclasses.replace(demo.RECIPE, steps=STEPS)
    assert changed.fingerprint(corpus, template) != fingerprint
    assert demo.RECIPE.fingerprint(corpus + " ", template) != fingerprint
    # A cache built before (or with another) template is not taken for this one.
    assert demo.RECIPE.fingerprint(corpus, template + " ") != fingerprint


def test_transformers_renders_the_demo_chat_template_as_the_server_does(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    from service.text.chat_template import Chat, ChatTemplate

    messages = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Who was Ishmael?"},
        {"role": "assistant", "content": "A sailor."},
        {"role": "user", "content": "And Ahab? "},
    ]
    theirs = AutoTokenizer.from_pretrained(demo_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    template = ChatTemplate.load(demo_dir)
    assert template is not None
    assert template.render(Chat(messages=messages), max_chars=10_000) == theirs
    assert theirs.startswith("<s>System: You answer in one sentence.\n\nUser: Who was Ishmael?")
    assert theirs.endswith("User: And Ahab?\n\nAssistant:")


def test_concurrent_callers_share_one_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = []
    build = demo.build_demo_checkpoint

    def counting_build(*args: object) -> None:
        builds.append(args)
        build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(demo, "build_demo_checkpoint", counting_build)
    results: list[Path] = []
    callers = [
        threading.Thread(target=lambda: results.append(ensure_demo_checkpoint(tmp_path, STEPS)))
        for _ in range(3)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1
    assert len(results) == 3 and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [results[0].name]


def test_demo_module_does_not_import_transformers() -> None:
    code = "import sys, engine.demo.checkpoint; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
