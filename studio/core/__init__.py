"""Plain Python, fast to import, never torch: what the UI, the CLI, the worker and the engine share.

Sub-packages, each saying in its own docstring what it holds:

- ``config``: the run configuration (dataclasses <-> YAML; Ludwig, PEFT and TRL names);
- ``data``: datasets (load, browse, shapes, fields, split, statistics and lint, encoding, pairs);
- ``prompt``: templates, chat templates, token ids and labels, tokenizers without torch;
- ``grpo``: GRPO's rows and rewards;
- ``memory``: the memory estimate, the automatic plan, the GPUs of this machine;
- ``model``: a model's shape and where it comes from; ``decoder``: a decoder layer described as data;
- ``runs``: the run directory and what is read from it (report, scoring, table cells, storage);
- ``export``: the model card, Ollama's Modelfile and chat template.

Modules: ``events`` (the worker protocol), ``plan`` (which training path a run takes), ``paths``
(bundled files, caches and settings).
"""
