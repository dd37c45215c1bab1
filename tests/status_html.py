"""Reads the status page's tables back as text, the way a person (or a browser's DOM) sees them."""

from __future__ import annotations

import urllib.request
from html.parser import HTMLParser


class TableCells(HTMLParser):
    """The text of every header and cell of the table whose id is ``table_id``, row by row (entities decoded)."""

    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id = table_id
        self.rows: list[list[str]] = []
        self._inside = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", self.table_id) in attrs:
            self._inside = True
        elif self._inside and tag == "tr":
            self.rows.append([])
        elif self._inside and tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._inside = False
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def cells(page: str, table_id: str) -> dict[str, dict[str, str]]:
    """First cell (the job, or the time of an error) -> {column header: cell text} of that row."""
    parser = TableCells(table_id)
    parser.feed(page)
    if not parser.rows:
        return {}
    header, *rows = parser.rows
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def job_row(metrics_port: int, job_id: str) -> dict[str, str]:
    """``job_id``'s row of a running aggregator's /status page, {column header: cell text}; {} while it has none."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status", timeout=5) as answer:
        return cells(answer.read().decode(), "jobs").get(job_id, {})
