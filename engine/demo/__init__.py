"""The built-in demo model (`--model demo`): `checkpoint` trains it on `demo_corpus.txt` once and
writes `chat_template.jinja` beside it; `python -m engine.demo` builds it in the foreground.

Apart from the engine proper: only `engine.execution.model_shard` imports it, when the model is `demo`. May
import `models` and `attention`.
"""
