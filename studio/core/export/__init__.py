"""What an export writes beside the weights, in plain Python.

- ``model_card``: the exported adapter's README.md and its loss chart;
- ``modelfile``: an Ollama Modelfile from the run's prompt template or the model's chat template;
- ``ollama_chat``: a Jinja chat template's per-message turns as Ollama's Go template.

The weights themselves (adapter, merged, GGUF) are written by studio/engine/exporting.py.
"""
