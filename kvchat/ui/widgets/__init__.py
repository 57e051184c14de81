"""Widgets of the chat screen: message list, message box, memory gauge, comparison panel."""
