"""Tiny random Hugging Face checkpoints for tests, written exactly as real ones are.

`make_checkpoint` writes config.json, safetensors weights (sharded if asked),
generation_config.json and a byte-level BPE tokenizer.json trained on the fly, so the code under
test loads them through the same path as a downloaded checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be, or not to be, that is the question. It was the best of times, it was the
worst of times. All happy families are alike; each unhappy family is unhappy in its own way.
Call me Ishmael. In the beginning God created the heaven and the earth. The sea was calm and
the sky was grey; the ships waited in the harbour for the tide. Numbers: 0 1 2 3 4 5 6 7 8 9.
Café, naïve, façade, jalapeño, über, smörgåsbord. 日本語のテキスト。中文文本。
Ελληνικά. Русский текст.
Emoji: 😀 🚀 🌍 ✨. Symbols: ← → ∑ ∞ ≈ ≠ ± °C €100 £5 ¥300.
def main(): return {"key": [1, 2, 3], 'value': None}  # code, too
"""

SPECIAL_TOKENS = ["<s>", "</s>"]

# Small but structurally complete: GQA (4 query heads over 2 KV heads), 2 layers.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,  # peaked enough that greedy argmax has no near-ties
}

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"tie_word_embeddings": False, "sliding_window": None},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": False, "head_dim": 32},  # head_dim != hidden / heads
    # Mixture of experts: 8 experts, top-2, expert sizes apart from the dense MLP's.
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
    },
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
    },
    # Phi-3/4: fused qkv_proj and gate_up_proj tensors; its config's pad id (32000) is outside
    # a tiny vocabulary.
    "phi3": {"tie_word_embeddings": False, "pad_token_id": None},
    # Gemma: 4 layers, sliding (window 8) and full; no pad id (transformers' default, 0, is our
    # BOS: its embedding row would be zeroed).
    "gemma2": {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 4, "pad_token_id": None},
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 8,
        "num_hidden_layers": 4,
        "pad_token_id": None,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
    # gpt-oss: 4 experts top-2 with biases, layers alternating an 8-token window and full
    # attention, YaRN, learned sinks; a low swiglu_limit so that the clamps bite. Its biases
    # and sinks are drawn at random (transformers initialises most of them to zero).
    "gpt_oss": {
        "tie_word_embeddings": False,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "sliding_window": 8,
        "swiglu_limit": 1.0,
    },
}


def make_tokenizer(vocab_size: int = 320, corpus: Iterable[str] = (CORPUS,) * 4) -> Any:
    """A byte-level BPE tokenizer trained on CORPUS: every UTF-8 string encodes; <s> is BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def make_llama2_tokenizer(
    vocab_size: int = 200, corpus: Iterable[str] = (CORPUS,) * 4, alphabet: int = 40
) -> Any:
    """A Llama 2 style tokenizer: BPE with byte fallback (<0x00>..<0xFF> in the vocabulary after
    <unk>, <s>, </s>), the Metaspace pre-tokenizer and Llama 2's decoder sequence. Only the
    `alphabet` most frequent characters are tokens; the others encode as byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=alphabet, show_progress=False
    )
    trained.train_from_iterator(corpus, trainer)
    model = json.loads(trained.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(specials)
    return tok


def make_checkpoint(
    directory: Path,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` (llama, mistral, qwen2, qwen3, phi3, gemma2,
    gemma3_text, and the mixture-of-experts mixtral, qwen2_moe, qwen3_moe, gpt_oss) into
    directory."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    kwargs = {**BASE_CONFIG, **ARCH_DEFAULTS[arch], **config_overrides}
    config = config_class(
        vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=eos, **kwargs
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    if arch == "gpt_oss":
        _randomize_biases_and_sinks(model, seed)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **save_kwargs)
    return directory


def _randomize_biases_and_sinks(model: Any, seed: int) -> None:
    """Every bias and attention sink drawn from N(0, 0.5): a checkpoint whose biases are zero
    (transformers' initialisation of the experts') would not tell whether they are added."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def load_hf_model(directory: Path) -> Any:
    """The transformers reference model for a checkpoint, float32, eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def prompts(vocab_size: int, count: int = 16) -> list[list[int]]:
    """`count` prompts of different lengths (4..124 tokens), BOS first, deterministic."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [
        [0, *torch.randint(2, vocab_size, (3 + 8 * k,), generator=gen).tolist()]
        for k in range(count)
    ]


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF generate's `new_tokens` greedy ids (no EOS stops it) and the log_softmax of the
    logits behind each of them."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)


# The chat templates of the supported families (tests/chat_templates/, copied from the
# checkpoints' tokenizer_config.json) and the tokens they write: special tokens (whole, never
# split) and, for Qwen, the plain added tokens of its vocabulary.
CHAT_TEMPLATES = Path(__file__).parents[1] / "chat_templates"
CHAT_FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {
        "template": "llama3.jinja",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "added": [],
    },
    "mistral": {
        "template": "mistral.jinja",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "special": [
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "added": [],
    },
    "qwen2_5": {
        "template": "qwen2_5.jinja",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>"],
    },
    "qwen3": {
        "template": "qwen3.jinja",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<think>", "</think>"]
        + ["<tool_response>", "</tool_response>"],
    },
}


def write_chat_tokenizer(directory: Path, family: str, in_config: bool = True) -> Path:
    """The tiny trained tokenizer plus `family`'s chat tokens, and a tokenizer_config.json with
    its chat template (or, `in_config` False, a chat_template.jinja beside it), as a real
    checkpoint of that family ships them."""
    from tokenizers import AddedToken

    spec = CHAT_FAMILIES[family]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    tok.save(str(directory / "tokenizer.json"))
    template = (CHAT_TEMPLATES / spec["template"]).read_text()
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos_token"],
        "eos_token": spec["eos_token"],
    }
    if in_config:
        config["chat_template"] = template
    else:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
