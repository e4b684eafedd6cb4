"""The built-in demo model (`--model demo`): `checkpoint` trains it on `demo_corpus.txt` once and
writes `chat_template.jinja` beside it; `python -m engine.demo` builds it in the foreground.
`recipe` holds what determines each checkpoint (the demo's, its draft's, its copy model's);
`copy_units` makes the training text of the copy model (bench/speculative.py's copy task).

Apart from the engine proper: only the model shard (engine/execution/model_shard.py) imports
it, when the model is `demo`.
May import: engine.models, engine.attention
"""
