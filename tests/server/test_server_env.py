"""The aggregator's GRADQ_* variables: one table, parsed one way, as `gradq serve --help` and docs/operating.md say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from waiting import wait_until

from gradq.client import WorkerClient
from gradq.server import healthcheck
from gradq.server.cli import build_parser
from gradq.server.env import HEALTHCHECK_ENVIRONMENT, SERVE_ENVIRONMENT, SERVER_PARSERS, read_variable

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
HEADING = "## Environment variables of `gradq serve`"


def documented_rows() -> dict[str, str]:
    """Variable -> its flag, from the table under HEADING: rows ``| `GRADQ_X` | `--flag` | meaning |``."""
    section = OPERATING.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(GRADQ_[A-Z_]+)` \| `(--[a-z-]+)` \| (.+) \|$", section, re.MULTILINE)
    assert all(meaning.strip() for _, _, meaning in rows), rows
    return {name: flag for name, flag, _ in rows}


def serve_flags() -> dict[str, str]:
    """Variable -> flag, as `gradq serve --help` gives them (each help ends ``[env GRADQ_X]``)."""
    flags = {}
    for action in build_parser()._actions:
        help_text = action.help or ""
        found = re.search(r"\[env (GRADQ_[A-Z_]+)\]$", help_text)
        if found:
            flags[found[1]] = action.option_strings[0]
            assert help_text.startswith(SERVE_ENVIRONMENT[found[1]]), help_text
    return flags


def test_every_variable_has_one_meaning_and_one_parser() -> None:
    assert set(SERVER_PARSERS) == set(SERVE_ENVIRONMENT) | set(HEALTHCHECK_ENVIRONMENT)
    assert not set(SERVE_ENVIRONMENT) & set(HEALTHCHECK_ENVIRONMENT)
    # The worker's names mean a worker's things: the server has names of its own.
    assert {"GRADQ_HOST", "GRADQ_TOKEN_FILE"}.isdisjoint(SERVER_PARSERS)
    assert {"GRADQ_BIND_HOST", "GRADQ_TOKEN_TABLE"} <= set(SERVE_ENVIRONMENT)


def test_the_table_is_what_gradq_serve_help_says() -> None:
    assert set(serve_flags()) == set(SERVE_ENVIRONMENT)
    text = build_parser().format_help()
    for name in SERVE_ENVIRONMENT:
        assert name in text


def test_the_table_is_what_docs_operating_says(capsys: pytest.CaptureFixture[str]) -> None:
    documented = documented_rows()
    assert sorted(documented) == sorted(SERVER_PARSERS)
    flags = serve_flags()
    for name in SERVE_ENVIRONMENT:
        assert documented[name] == flags[name], name
    with pytest.raises(SystemExit):
        healthcheck.main(["--help"])
    checked = " ".join(capsys.readouterr().out.split())
    for name in HEALTHCHECK_ENVIRONMENT:
        assert f"{documented[name]} " in checked and f"[env {name}]" in checked, name


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("GRADQ_SERVER_ERROR_FEEDBACK", "", None),
        ("GRADQ_SERVER_ERROR_FEEDBACK", "  ", None),
        ("GRADQ_SERVER_ERROR_FEEDBACK", "Yes", True),
        ("GRADQ_SERVER_ERROR_FEEDBACK", "off", False),
        ("GRADQ_PORT", "0", 0),
        ("GRADQ_ROUND_TIMEOUT", "2.5", 2.5),
    ],
)
def test_blank_is_unset_and_values_parse(name: str, text: str, expected: object) -> None:
    assert read_variable({name: text}, name) == expected


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "GRADQ_SERVER_ERROR_FEEDBACK",
            "maybe",
            "GRADQ_SERVER_ERROR_FEEDBACK='maybe' is invalid; expected auto or one of 1",
        ),
        ("GRADQ_SERVER_ERROR_FEEDBACK", "2", "GRADQ_SERVER_ERROR_FEEDBACK='2' is invalid; expected auto"),
        ("GRADQ_PORT", "http", "GRADQ_PORT='http' is invalid; expected a port in 0..65535"),
        ("GRADQ_MAX_JOBS", "many", "GRADQ_MAX_JOBS='many' is invalid; expected an integer"),
        ("GRADQ_GRACE", "inf", "GRADQ_GRACE='inf' is invalid; expected a finite number"),
    ],
)
def test_a_bad_value_is_refused_naming_variable_value_and_expectation(name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        read_variable({name: text}, name)
    assert str(refused.value).startswith(message)


def test_a_blank_variable_leaves_the_default_of_gradq_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADQ_WORLD_SIZE", "")
    monkeypatch.setenv("GRADQ_SERVER_ERROR_FEEDBACK", "")
    args = build_parser().parse_args([])
    assert (args.world_size, args.server_error_feedback) == (0, None)  # None: auto


def test_the_servers_own_names_set_bind_address_and_token_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret job=j\n")
    monkeypatch.setenv("GRADQ_BIND_HOST", "127.0.0.1")
    monkeypatch.setenv("GRADQ_TOKEN_TABLE", str(tokens))
    args = build_parser().parse_args([])
    assert (args.host, args.token_file) == ("127.0.0.1", tokens)


def test_a_workers_variables_change_neither_bind_address_nor_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("worker-secret\n")
    monkeypatch.setenv("GRADQ_HOST", "node-a")
    monkeypatch.setenv("GRADQ_TOKEN_FILE", str(token))
    args = build_parser().parse_args([])
    assert (args.host, args.token_file) == (build_parser().get_default("host"), None)


@pytest.fixture
def serve_with_worker_variables(tmp_path: Path) -> Iterator[int]:
    """A real `gradq serve` whose environment also holds a worker's GRADQ_HOST and GRADQ_TOKEN_FILE."""
    token, port_file = tmp_path / "token", tmp_path / "port"
    token.write_text("worker-secret\n")
    env = {
        **os.environ,
        "GRADQ_HOST": "node-a",  # no address of this host: binding it would fail
        "GRADQ_TOKEN_FILE": str(token),  # one line, a token table would accept it: it must not be read
        "GRADQ_BIND_HOST": "127.0.0.1",
        "GRADQ_PORT": "0",
        "GRADQ_PORT_FILE": str(port_file),
    }
    process = subprocess.Popen([sys.executable, "-m", "gradq.server"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(
            lambda: process.poll() is not None or (port_file.exists() and port_file.read_text().strip()),
            "gradq serve to write its port",
            60,
        )
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        yield int(port_file.read_text())
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_served_aggregator_ignores_a_workers_variables(serve_with_worker_variables: int) -> None:
    # Bound to GRADQ_BIND_HOST, and no token table: a worker without a token joins.
    with WorkerClient(f"127.0.0.1:{serve_with_worker_variables}", "j", 0, 1, timeout_s=10) as client:
        assert client.membership.rank == 0
    with grpc.insecure_channel(f"127.0.0.1:{serve_with_worker_variables}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
