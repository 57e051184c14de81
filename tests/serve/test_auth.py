"""Bind rules and the Bearer check."""

import pytest

from kvchat.errors import KvchatError
from kvchat.serve.auth import bearer_matches, check_bind, is_loopback
from kvchat.serve.redact import Redactor


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_key(host):
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.4", "example.org"])
def test_any_other_address_needs_a_key(host):
    with pytest.raises(KvchatError, match="--api-key"):
        check_bind(host, None)
    check_bind(host, "k")


def test_bearer_token():
    assert bearer_matches("Bearer s3cret", "s3cret")
    assert bearer_matches("bearer s3cret", "s3cret")
    assert not bearer_matches("Bearer s3cre", "s3cret")
    assert not bearer_matches("s3cret", "s3cret")
    assert not bearer_matches(None, "s3cret")


def test_paths_outside_the_data_dir_are_hidden(tmp_path):
    redact = Redactor(tmp_path / "data")
    message = (
        f"cannot read {tmp_path}/data/conversations/abc/manifest.json; "
        "model at /root/.cache/kvchat/models/x, 20 tok/s, see ~/notes/a.txt"
    )
    out = redact(message)
    assert str(tmp_path) not in out and "/root" not in out and "~/notes" not in out
    assert "<data-dir>/conversations/abc/manifest.json" in out and "20 tok/s" in out
