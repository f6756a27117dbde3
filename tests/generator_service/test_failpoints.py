"""Failpoint files (`generator_service.failpoints`), without a server: each armed point fires
once at its count, the others stay armed, and the file goes once none is left."""

from __future__ import annotations

import pytest

from generator_service import failpoints


@pytest.fixture
def armed(tmp_path, monkeypatch):
    path = tmp_path / "failpoints"
    monkeypatch.setenv(failpoints.ENV, str(path))
    return path


def test_points_fire_once_each_and_the_rest_stay_armed(armed):
    armed.write_text("pause_for_swap 1 tokens=50\nreload_weights 1 fail\n")
    assert failpoints.hit("generate_completion") is None
    assert failpoints.hit("pause_for_swap") == "tokens=50"  # a hold the engine performs
    assert armed.read_text() == "reload_weights 1 fail\n"
    with pytest.raises(failpoints.FailpointError, match="reload_weights 1 fail"):
        failpoints.hit("reload_weights")
    assert not armed.exists()
    assert failpoints.hit("reload_weights") is None
    assert failpoints.hit("pause_for_swap") is None


def test_a_point_fires_at_its_count(armed):
    armed.write_text("update_weights 3 fail\n")
    for _ in range(2):
        assert failpoints.hit("update_weights") is None
    assert armed.exists()
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("update_weights")
    assert not armed.exists()
