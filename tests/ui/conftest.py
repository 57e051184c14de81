"""Fixtures for the UI tests: an app on the fake engine, with conversations kept in tmp."""

from __future__ import annotations

import pytest

from kvchat.ui.app import KvchatApp
from tests.ui.fakes import FakeBackend


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _private_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
def make_app():
    def make(**kwargs) -> KvchatApp:
        return KvchatApp(FakeBackend(**kwargs))

    return make
