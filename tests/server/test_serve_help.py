"""`gradq serve --help` reads in groups with one default per flag; a bad flag is one line naming the flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

GROUPS = ("serving", "rounds", "limits", "security", "shards", "observability")
# At 80 columns, a flag's entry takes at most this many lines (its help at most three); before the flags were
# grouped and their help cut short, an entry took up to 7 and the whole help 208 lines for 40 flags.
MOST_LINES_PER_FLAG = 4


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`gradq serve ARGS` through the console entry's module, on a terminal 80 columns wide."""
    return subprocess.run(
        [sys.executable, "-m", "gradq.cli", "serve", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80", **(env or {})},
        timeout=60,
    )


def flag_lines(text: str) -> dict[str, list[str]]:
    """Flag -> the lines of its help entry (the flag's line and those indented under it), from --help's text."""
    entries: dict[str, list[str]] = {}
    flag = ""
    for line in text.splitlines():
        found = re.match(r"^  (--[a-z-]+)", line)
        if found:
            flag = found[1]
            entries[flag] = [line]
        elif flag and line.startswith("   "):
            entries[flag].append(line.strip())
        else:
            flag = ""
    return entries


def flag_entries(text: str) -> dict[str, str]:
    """Flag -> its help entry as one line."""
    return {flag: " ".join(lines) for flag, lines in flag_lines(text).items()}


@pytest.fixture(scope="module")
def help_text() -> str:
    completed = run_serve("--help")
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_help_groups_the_flags_under_headings(help_text: str) -> None:
    headings = re.findall(r"^([a-z][a-zA-Z ]*):$", help_text, re.MULTILINE)
    assert [heading for heading in headings if heading in GROUPS] == list(GROUPS)
    entries = flag_entries(help_text)
    # Each group holds its own flags: the sections are cut at the headings.
    sections = dict(re.findall(r"^([a-z]+):\n((?:(?!^[a-z]).*\n?)*)", help_text, re.MULTILINE))
    assert "--round-timeout" in sections["rounds"] and "--round-timeout" not in sections["limits"]
    assert "--max-jobs " in sections["limits"]
    assert "--tls-cert" in sections["security"] and "--token-file" in sections["security"]
    assert "--shard-ports" in sections["shards"]
    assert "--metrics-port" in sections["observability"]
    assert len(entries) >= 40


def test_each_flag_shows_at_most_one_default(help_text: str) -> None:
    entries = flag_entries(help_text)
    doubled = {flag: entry for flag, entry in entries.items() if len(re.findall(r"\bdefault\b", entry)) > 1}
    assert not doubled
    assert "(default: None)" not in help_text
    assert "(default 30)" in entries["--round-timeout"]
    assert "(default 1, or one per --shard-ports)" in entries["--shards"]


def test_help_is_short(help_text: str) -> None:
    entries = flag_lines(help_text)
    long = {flag: lines for flag, lines in entries.items() if len(lines) > MOST_LINES_PER_FLAG}
    assert not long
    # About three lines a flag, with the usage, description and group headings: 135 for 40 flags.
    assert len(help_text.splitlines()) <= 3 * len(entries) + 15, len(help_text.splitlines())
    usage = help_text.split("\n\n", 1)[0]
    assert len(usage.splitlines()) == 1, usage


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--round-timeout", "-1"], {}, "--round-timeout=-1.0 is invalid; expected > 0 seconds"),
        (["--round-timeout", "soon"], {}, "--round-timeout='soon' is invalid; expected a number"),
        (["--non-finite", "maybe"], {}, "--non-finite='maybe' is invalid; expected 'reject' or 'skip'"),
        (["--max-jobs", "0"], {}, "--max-jobs=0 is invalid; expected >= 1"),
        (["--job-idle-timeout", "0"], {}, "--job-idle-timeout=0.0 is invalid; expected > 0 seconds"),
        (["--keepalive-timeout", "0.01"], {}, "--keepalive-timeout=0.01 is invalid; expected 0.1..3600 seconds"),
        (["--max-workers", "0"], {}, "--max-workers=0 is invalid; expected >= 1"),
        (["--exit-after-jobs", "-1"], {}, "--exit-after-jobs=-1 is invalid; expected 0"),
        (["--return-scheme", "per_channel_affine", "--return-bits", "9"], {}, "--return-bits=9 is out of range"),
        (["--partial-quorum", "3", "--world-size", "2"], {}, "--partial-quorum=3 is invalid; expected 0 (strict)"),
        (["--port", "70000"], {}, "--port='70000' is invalid; expected a port in 0..65535"),
        ([], {"GRADQ_ROUND_TIMEOUT": "-1"}, "GRADQ_ROUND_TIMEOUT=-1.0 is invalid; expected > 0 seconds"),
        ([], {"GRADQ_MAX_JOBS": "many"}, "GRADQ_MAX_JOBS='many' is invalid; expected an integer"),
    ],
)
def test_a_bad_flag_is_one_line_naming_flag_value_and_expectation(
    args: list[str], env: dict[str, str], message: str
) -> None:
    completed = run_serve("--port", "0", *args, env=env) if "--port" not in args else run_serve(*args, env=env)
    assert completed.returncode == 2
    lines = completed.stderr.splitlines()
    assert lines[0].startswith(f"gradq serve: error: {message}"), completed.stderr
    assert len(lines) <= 2, completed.stderr  # the error and at most a one-line hint, no usage block
    assert not re.search(r"\b[a-z]+(_[a-z]+)+=", completed.stderr), completed.stderr  # no internal field names
