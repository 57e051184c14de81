"""Conversation store: manifest + per-turn safetensors segments, atomic writes, checksums,
and a per-conversation lock. Knows files, not models."""

from kvchat.storage.manifest import (
    FORMAT_VERSION,
    AmbiguousConversationError,
    ConversationLockedError,
    ConversationNotFoundError,
    Manifest,
    ManifestEditedError,
    ManifestError,
    ModelInfo,
    ModelMismatchError,
    NewerFormatError,
    SaveFailedError,
    SegmentCorruptedError,
    SegmentInfo,
    Turn,
    UnsafeFileError,
)
from kvchat.storage.store import (
    Conversation,
    ConversationStore,
    ConversationSummary,
    DeleteOutcome,
)

__all__ = [
    "FORMAT_VERSION",
    "AmbiguousConversationError",
    "Conversation",
    "ConversationLockedError",
    "ConversationNotFoundError",
    "ConversationStore",
    "ConversationSummary",
    "DeleteOutcome",
    "Manifest",
    "ManifestEditedError",
    "ManifestError",
    "ModelInfo",
    "ModelMismatchError",
    "NewerFormatError",
    "SaveFailedError",
    "SegmentCorruptedError",
    "SegmentInfo",
    "Turn",
    "UnsafeFileError",
]
