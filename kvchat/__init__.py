"""kvchat: local terminal chat whose engine keeps a bounded KV-Direct cache."""

__version__ = "0.1.0"
