"""Queues and requests: waiting/running counts and one table row per request, updated by diff.

A waiting request's state says why it waits: ``wait tok`` (the step's token budget was spent),
``wait seq`` (``max_num_seqs`` run), ``wait kv`` (too few free KV blocks), ``wait host`` (a copy from
the host tier), ``wait ord`` (behind a request the policy put first).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable

from tui import format as fmt
from tui import palette
from tui.state import DashboardState, RequestRow

# (label, key); every cell carries a one-space gap before it, so that 80 columns hold the table.
COLUMNS = (("id", "id"), ("state", "state"), ("prompt", "prompt"), ("hit", "cached"), ("gen/max", "gen"),
           ("pre", "preempt"), ("ttft", "ttft"))
# Where a long-running server's numbers outgrow the panel (80 columns, ids past 9,999, 1k-token hits),
# these columns go first, in this order: the table never scrolls sideways.
DROP_ORDER = ("preempt", "cached", "prompt")
STATE_STYLES = {"waiting": palette.WAITING, "loading": palette.MOVED, "prefill": palette.PREFILL,
                "decode": palette.DECODE, "preempted": f"bold {palette.PREEMPT}"}

Cells = tuple[str, str, str, str, str, str, str]
Layout = tuple[tuple[int, int], ...]  # (column index, width) of each column shown
WAIT_LABELS = {"budget": "wait tok", "max_num_seqs": "wait seq", "kv_blocks": "wait kv", "host_load": "wait host",
               "order": "wait ord"}


def state_label(row: RequestRow) -> str:
    """The state column: a waiting request's names why it waits."""
    if row.state == "waiting" and row.waiting_reason:
        return WAIT_LABELS[row.waiting_reason]
    return row.state


def _tokens(value: int) -> str:
    return fmt.count(value) if value >= 1000 else str(value)


def _cells(row: RequestRow) -> Cells:
    return (str(row.request_id), state_label(row), _tokens(row.prompt_tokens),
            _tokens(row.cached_tokens) if row.cached_tokens else "",
            f"{_tokens(row.generated)}/{_tokens(row.max_tokens)}", str(row.preemptions) if row.preemptions else "",
            fmt.seconds(row.ttft) if row.ttft is not None else "")


def layout(cells: list[Cells], room: int) -> Layout:
    """The columns shown and their widths (gap included): every column while they fit in ``room``
    cells, else without ``DROP_ORDER``'s first ones; ``room`` 0 (not laid out yet) fits all."""
    widths = [1 + max([len(label), *(len(c[i]) for c in cells)]) for i, (label, _) in enumerate(COLUMNS)]
    shown = list(range(len(COLUMNS)))
    keys = [key for _, key in COLUMNS]
    for key in DROP_ORDER:
        if not room or sum(widths[i] for i in shown) <= room:
            break
        shown.remove(keys.index(key))
    return tuple((i, widths[i]) for i in shown)


def _render(cells: Cells, shown: Layout) -> list[Text]:
    state_style = STATE_STYLES.get("waiting" if cells[1].startswith("wait ") else cells[1], "dim")
    out = []
    for i, _ in shown:
        value = cells[i]
        style = state_style if i == 1 else ("dim" if state_style == "dim" else "")
        if i == 5 and value:
            style = palette.PREEMPT
        out.append(Text(f" {value}", style=style, justify="left" if i == 1 else "right"))
    return out


class RequestsPanel(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Queues"
        self._shown: dict[int, Cells] = {}
        self._order: list[int] = []
        self._layout: Layout = ()
        self._state: DashboardState | None = None

    def compose(self) -> ComposeResult:
        yield DataTable(cursor_type="none", show_cursor=False, cell_padding=0)

    def on_resize(self) -> None:
        if self._state is not None:  # the title's room and the columns that fit depend on the width
            self.call_after_refresh(self.show, self._state)

    def show(self, state: DashboardState) -> None:
        self._state = state
        reasons = state.waiting_reasons()
        why = ", ".join(f"{WAIT_LABELS[r].removeprefix('wait ')} {n}" for r, n in reasons.items() if n)
        parts = [(1, Text("Queues ")), (9, Text(f"waiting {state.waiting}", style=palette.WAITING)),
                 (4, Text(f" ({why})" if why else "", style=palette.WAITING)),
                 (9, Text.assemble(" · ", (f"running {state.running}", palette.DECODE))),
                 (5, Text(f" · done {state.num_finished}"))]
        if state.num_rejected:
            parts.append((6, Text.assemble(" · ", (f"rejected {state.num_rejected}", palette.REJECT))))
        self.border_title = fmt.fit(parts, self.outer_size.width - fmt.TITLE_INSET)
        table = self.query_one(DataTable)
        rows = state.table_rows()
        wanted = {row.request_id: _cells(row) for row in rows}
        # A vertical scrollbar takes a column once the rows and the header outgrow the table.
        room = self.content_region.width - (len(rows) + 1 > table.size.height)
        shown = layout(list(wanted.values()), room if self.content_region.width else 0)
        if shown != self._layout:
            self._rebuild(table, shown, wanted)
        else:
            self._update(table, wanted)
        order = [row.request_id for row in rows]
        if order != self._order:
            rank = {str(request_id): i for i, request_id in enumerate(order)}
            table.sort(COLUMNS[0][1], key=lambda cell: rank[cell.plain.strip()])
            self._order = order

    def _rebuild(self, table: DataTable, shown: Layout, wanted: dict[int, Cells]) -> None:
        # Fixed widths, computed here: a DataTable's own only ever grow, so a wide row gone (or a
        # reset) would leave them too wide.
        table.clear(columns=True)
        for i, width in shown:
            label, key = COLUMNS[i]
            table.add_column(Text(f" {label}", justify="left" if i == 1 else "right"), width=width, key=key)
        for request_id, cells in wanted.items():
            table.add_row(*_render(cells, shown), key=str(request_id))
        self._layout, self._shown, self._order = shown, dict(wanted), []

    def _update(self, table: DataTable, wanted: dict[int, Cells]) -> None:
        for request_id in [r for r in self._shown if r not in wanted]:
            table.remove_row(str(request_id))
            del self._shown[request_id]
        for request_id, cells in wanted.items():
            old = self._shown.get(request_id)
            if old is None:
                table.add_row(*_render(cells, self._layout), key=str(request_id))
            elif old != cells:
                rendered = _render(cells, self._layout)
                for (i, _), text in zip(self._layout, rendered):
                    if old[i] != cells[i] or old[1] != cells[1]:  # a state change restyles the whole row
                        table.update_cell(str(request_id), COLUMNS[i][1], text)
            self._shown[request_id] = cells
