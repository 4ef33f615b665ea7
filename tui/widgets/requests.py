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

# (label, key); cells carry their own one-space gap so that 80 columns hold the whole table.
COLUMNS = (("  id", "id"), (" state", "state"), (" prompt", "prompt"), (" hit", "cached"), (" gen/max", "gen"),
           (" pre", "preempt"), ("  ttft", "ttft"))
STATE_STYLES = {"waiting": palette.WAITING, "loading": palette.MOVED, "prefill": palette.PREFILL,
                "decode": palette.DECODE, "preempted": f"bold {palette.PREEMPT}"}

Cells = tuple[str, str, str, str, str, str, str]
WAIT_LABELS = {"budget": "wait tok", "max_num_seqs": "wait seq", "kv_blocks": "wait kv", "host_load": "wait host",
               "order": "wait ord"}


def state_label(row: RequestRow) -> str:
    """The state column: a waiting request's names why it waits."""
    if row.state == "waiting" and row.waiting_reason:
        return WAIT_LABELS[row.waiting_reason]
    return row.state


def _cells(row: RequestRow) -> Cells:
    return (str(row.request_id), state_label(row), str(row.prompt_tokens), str(row.cached_tokens) if row.cached_tokens else "",
            f"{row.generated}/{row.max_tokens}", str(row.preemptions) if row.preemptions else "",
            fmt.seconds(row.ttft) if row.ttft is not None else "")


def _render(cells: Cells) -> list[Text]:
    state_style = STATE_STYLES.get("waiting" if cells[1].startswith("wait ") else cells[1], "dim")
    out = []
    for i, value in enumerate(cells):
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
        self._state: DashboardState | None = None

    def compose(self) -> ComposeResult:
        table: DataTable[Text] = DataTable(cursor_type="none", show_cursor=False, cell_padding=0)
        for label, key in COLUMNS:
            table.add_column(label, key=key)
        yield table

    def on_resize(self) -> None:
        if self._state is not None:  # the title's room depends on the width
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
        for request_id in [r for r in self._shown if r not in wanted]:
            table.remove_row(str(request_id))
            del self._shown[request_id]
        for request_id, cells in wanted.items():
            old = self._shown.get(request_id)
            if old is None:
                table.add_row(*_render(cells), key=str(request_id))
            elif old != cells:
                rendered = _render(cells)
                for i, (label, key) in enumerate(COLUMNS):
                    if old[i] != cells[i] or old[1] != cells[1]:  # a state change restyles the whole row
                        # A row that turns "preempted" or gets its ttft outgrows the column it was added to.
                        table.update_cell(str(request_id), key, rendered[i], update_width=True)
            self._shown[request_id] = cells
        order = [row.request_id for row in rows]
        if order != self._order:
            rank = {str(request_id): i for i, request_id in enumerate(order)}
            table.sort("id", key=lambda cell: rank[cell.plain.strip()])
            self._order = order
