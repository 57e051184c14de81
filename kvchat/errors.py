"""User-facing errors.

Every error a user can cause carries a one-line message that says what to do. The CLI
and the UI print ``str(error)`` and nothing else: no traceback.
"""


class KvchatError(Exception):
    """Base class: the message is one line, addressed to the user, naming the fix."""


class ModelNotFoundError(KvchatError):
    """The model is neither local, nor cached, nor downloadable right now."""


class ModelLoadError(KvchatError):
    """The model files exist but could not be loaded."""


class CeilingTooSmallError(KvchatError):
    """--max-mem cannot hold even the minimum state the engine needs."""


class NeedsDiskTierError(KvchatError):
    """The checkpoints alone would pass --max-mem and no disk tier is enabled."""


class StorageError(KvchatError):
    """A conversation file is unreadable, corrupted, locked or from an incompatible setup."""


class ContextTooLongError(KvchatError):
    """The conversation would pass the model's context length (max_position_embeddings)."""
