"""The engine: a model loaded (``models``), the KV-Direct cache (``kvdirect``), and a chat on
top of them (``chat``). It never imports the UI, the server or the lab; storage is below it."""
