"""Screens pushed over the chat: help, settings, saved conversations, memory, errors."""
