"""Short human units, and lines fitted to narrow panels."""

from __future__ import annotations

from rich.text import Text

TITLE_INSET = 6  # a border title's room is the panel's width less its corners and the blanks beside it


def seconds(value: float | None) -> str:
    """At most five cells: the unit is chosen after rounding, so 999.7 µs reads ``1ms``, not ``1000µs``."""
    if value is None:
        return "-"
    for scale, unit in ((1e6, "µs"), (1e3, "ms")):
        if round(value * scale) < 1000:
            return f"{value * scale:.0f}{unit}"
    if round(value, 1) < 100:
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


def size(num_bytes: float) -> str:
    """Bytes in binary units: 512 B, 64 KiB, 1.8 MiB, 12 GiB."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if value >= 10 or unit == "B" else f"{value:.1f} {unit}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def fit(parts: list[tuple[int, Text]], width: int) -> Text:
    """Join ``parts`` (priority, text) in order, leaving out the lowest priorities until the line fits
    ``width`` cells; what still does not fit ends in an ellipsis. A narrow terminal keeps what
    matters on one line instead of wrapping onto a second."""
    kept = parts
    for priority in sorted({priority for priority, _ in parts}):
        if sum(text.cell_len for _, text in kept) <= width or len({p for p, _ in kept}) == 1:
            break
        kept = [(p, text) for p, text in kept if p != priority]
    line = Text(no_wrap=True, overflow="ellipsis").join(text for _, text in kept)
    line.truncate(width, overflow="ellipsis")
    return line
