"""Keep file paths out of what the server returns.

Engine and storage errors name files so a person at a terminal can fix them; a remote
client must not learn the layout of the host. Paths under the data dir are shown relative
to it, any other absolute path is replaced by a placeholder.
"""

from __future__ import annotations

import re
from pathlib import Path

_ABSOLUTE_PATH = re.compile(r"(?<![\w.~>])(?:~/|/)(?:[\w.@+-]+/)*[\w.@+-]+/?")


class Redactor:
    def __init__(self, data_dir: Path) -> None:
        self._data_dir = str(Path(data_dir).expanduser().resolve())
        self._data_dir_as_given = str(Path(data_dir).expanduser())

    def __call__(self, message: str) -> str:
        for root in {self._data_dir, self._data_dir_as_given}:
            message = message.replace(root + "/", "<data-dir>/").replace(root, "<data-dir>")
        return _ABSOLUTE_PATH.sub(_placeholder, message)


def _placeholder(match: re.Match[str]) -> str:
    text = match.group(0)
    if text.count("/") < 2 and not text.startswith("~"):
        return text  # "/s" in "tok/s", "/v1": not a file path worth hiding
    return "<path>"
