"""The README's Python snippets, run as a newcomer runs it, prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_CHECKPOINT = "/tmp/tiny"  # where the README's `python -m models.checkpoint` line puts it


def readme_snippet() -> str:
    section = (REPO / "README.md").read_text().split("## Using the engine", 1)[1]
    snippet, = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.DOTALL)
    return snippet


def test_the_readme_snippet_prints_one_event_per_line_then_the_text(tiny_checkpoint, tmp_path):
    snippet = readme_snippet()
    assert snippet.count(f'"{README_CHECKPOINT}"') == 1, "the snippet no longer loads the README's checkpoint"
    # A fresh interpreter, away from the repository: what a reader pastes into `python`.
    result = subprocess.run([sys.executable, "-c", snippet.replace(README_CHECKPOINT, str(tiny_checkpoint))],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # No progress bar: on a terminal it would share its lines with the events.
    assert "Generating" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    events = [line for line in lines if re.match(r"[A-Z]\w*\(t=", line)]
    assert events == lines[:len(events)], "something other than an event was printed among them"
    kinds = {line.split("(", 1)[0] for line in events}
    assert {"EngineStarted", "RequestArrived", "Schedule", "Tokens", "Step", "RequestFinished"} <= kinds
    # Then the first output (its text may itself hold newlines) and its token ids.
    output = "\n".join(lines[len(events):])
    text, ids = re.fullmatch(r"(.*) \[([\d, ]+)\]", output, flags=re.DOTALL).groups()
    assert len(ids.split(",")) == 16
    assert "<|filler_" in text  # the README explains the filler tokens a random-weight model emits


def test_the_readme_serving_snippet_talks_to_the_server(tiny_checkpoint, tmp_path):
    """The "Serving real clients" snippet, pointed at a server on a free port instead of 8000."""
    from tests.servers import threaded_server

    section = (REPO / "README.md").read_text().split("## Serving real clients", 1)[1].split("\n## ", 1)[0]
    command, = re.findall(r"```bash\n(python -m serve [^\n]*)", section)
    assert "--preset tiny --port 8000" in command
    snippet, = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert snippet.count("http://127.0.0.1:8000/v1") == 1
    with threaded_server(tiny_checkpoint, name="tiny") as server:
        result = subprocess.run([sys.executable, "-c", snippet.replace("http://127.0.0.1:8000", server.url)],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "<|filler_" in result.stdout  # both answers printed: random weights speak in filler tokens


@pytest.mark.parametrize("heading", ["A second KV tier in host memory", "Contexts larger than the GPU: CPU-offload mode",
                                     "Scheduling: batching rules and queue policies"])
def test_a_readme_section_snippet_prints_what_the_readme_says(heading, tiny_checkpoint, tmp_path):
    section = (REPO / "README.md").read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    snippet, = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    promised, = re.findall(r"It prints `([^`]+)`", section)
    result = subprocess.run([sys.executable, "-c", snippet.replace(README_CHECKPOINT, str(tiny_checkpoint))],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == promised
