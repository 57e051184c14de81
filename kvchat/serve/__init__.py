"""``kvchat serve``: an OpenAI-compatible chat server over saved, resumable conversations.

One engine worker thread serves requests in turn (a chat session is not thread-safe); a
request whose messages extend a saved conversation continues from its files instead of
prefilling the text again. Modules: ``protocol`` (request validation, OpenAI shapes),
``matcher`` (which saved conversation a request continues), ``worker`` (the queue and the
single active session), ``sse`` (streaming), ``auth`` (bind rules, Bearer check),
``redact`` (no paths outside the data dir in responses), ``app`` (routes), ``server``
(uvicorn, SIGTERM).
"""
