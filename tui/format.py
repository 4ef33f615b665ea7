"""Short human units for narrow panels."""

from __future__ import annotations


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f}µs"
    if value < 1.0:
        return f"{value * 1e3:.0f}ms"
    if value < 100:
        return f"{value:.1f}s"
    return f"{value:.0f}s"


def clock(value: float) -> str:
    minutes, secs = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def count(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"
