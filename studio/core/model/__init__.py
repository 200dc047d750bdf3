"""The base model as plain data, before any weights load.

- ``info``: the shape of a causal LM (hidden size, layers, heads, vocabulary, ...) from its config.json;
- ``ref``: what ``model.base_model`` names (a local folder or a hub id) and what is wrong with a folder;
- ``source``: where the VRAM pane's model field finds a model's config.json (a file, a folder, the
  caches, the Hub, the bundled sample configs).

How a decoder layer is built (norms, attention, MLP) is described in the sibling package
core/decoder/. No torch here.
"""
