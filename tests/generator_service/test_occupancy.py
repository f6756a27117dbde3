"""The engine's occupancy totals come with the span they cover, on the server's clock (a fake
one here, by hand), so that a client dividing their changes between two statuses divides by the
server's span rather than its own clock's (whose two calls' latencies differ)."""

from __future__ import annotations

from generator_service import status


def test_the_totals_come_with_the_seconds_they_cover(monkeypatch):
    clock = iter([10.0, 11.0, 13.5, 14.0, 16.0])
    monkeypatch.setattr(status.time, "monotonic", lambda: next(clock))
    occupancy = status.Occupancy(capacity=4)  # t = 10
    occupancy.started()  # t = 11: 1 s idle
    assert occupancy.totals() == (1.0, 2.5)  # t = 13.5: one request for 2.5 s
    assert occupancy.seconds == 3.5  # read with the totals: no clock of its own
    occupancy.finished()  # t = 14
    assert occupancy.totals() == (3.0, 3.0)  # t = 16: idle again since 14
    assert occupancy.seconds == 6.0
