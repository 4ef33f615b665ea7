"""The shipped Grafana dashboard (``grafana_dashboard.json``) and the PromQL inside it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

DASHBOARD_PATH = Path(__file__).with_name("grafana_dashboard.json")

_METRIC_NAME = re.compile(r"\b((?:vllm|glassbox):[a-zA-Z0-9_:]+)")


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_exprs(dashboard: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every PromQL target in the dashboard, in panel order."""
    dashboard = load_dashboard() if dashboard is None else dashboard
    return [
        (panel.get("title", ""), target["expr"])
        for panel in _panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace Grafana ``$name`` / ``${name}`` variables, longest names first."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """The ``vllm:`` and ``glassbox:`` series names an expression reads."""
    return set(_METRIC_NAME.findall(expr))
