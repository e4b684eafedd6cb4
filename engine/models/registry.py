"""The model registry: which module builds the model a checkpoint's `architectures` names.

`ARCHITECTURES` maps each supported Hugging Face architecture name to (module, class); the
class implements CausalLM, and `engine.models.base.model_class` imports it when a checkpoint
asks for it. Stdlib only: the config reader checks a checkpoint's architecture here without
importing any model. A new family adds its module under engine/models/ and its rows here;
nothing outside models/ names a family.
"""

from __future__ import annotations

from engine.models.llama_family import VARIANTS

ARCHITECTURES: dict[str, tuple[str, str]] = {
    **{name: ("engine.models.llama", "LlamaForCausalLM") for name in VARIANTS},
    "Phi3ForCausalLM": ("engine.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
    "Gemma4ForCausalLM": ("engine.models.gemma4", "Gemma4ForCausalLM"),
    "GptOssForCausalLM": ("engine.models.gpt_oss", "GptOssForCausalLM"),
}
