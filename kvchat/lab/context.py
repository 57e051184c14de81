"""What every lab experiment is given: where to write, how big to run, which models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REAL_MODELS = ("smollm2-135m", "gemma-3-270m")


@dataclass
class LabContext:
    results_dir: Path
    quick: bool = False
    device: str = "cpu"
    models: tuple[str, ...] = REAL_MODELS
    say: Callable[[str], None] = print
    _loaded: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)

    def figure(self, name: str) -> tuple[Path, str]:
        """(absolute path to save a PNG to, path relative to the results dir for the report)."""
        folder = self.results_dir / "figures"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{name}.png", f"figures/{name}.png"

    def pyplot(self, what: str) -> Any | None:
        """matplotlib's pyplot (headless), or None, with a line saying so, when it is not
        installed: plots are optional (``pip install -e ".[lab]"``), and the JSON and the
        report are written either way."""
        try:
            import matplotlib
        except ImportError:
            self.say(
                f"  matplotlib is not installed: no {what} figure "
                '(pip install -e ".[lab]" for the plots)'
            )
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt

    def save_figure(self, fig: Any, name: str) -> str:
        """Write ``fig`` as figures/NAME.png, close it, and return the path for the report."""
        import matplotlib.pyplot as plt

        path, rel = self.figure(name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return rel

    def load(self, spec: str, dtype: str = "float32") -> Any:
        """A real model as the engine holds it (``LoadedModel``), loaded once per run."""
        key = (spec, dtype)
        if key not in self._loaded:
            from transformers.utils import logging as hf_logging

            from kvchat.engine.models.load import load

            hf_logging.set_verbosity_error()
            self._loaded[key] = load(
                spec, device=self.device, dtype=dtype, weights="none", progress=self.say
            )
        return self._loaded[key]

    def release(self) -> None:
        self._loaded.clear()
