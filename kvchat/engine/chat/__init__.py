"""Run a chat: the session across turns, generation, sampling, detokenizing, saving."""
