"""deploy/monitoring against real programs: promtool checks the scrape config and the alert rules and makes each
alert fire, a real Prometheus scrapes a real `gradq serve` while a job trains, and every query of the Grafana
dashboard and of the alerts names only metrics and labels that a live /metrics exports.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dependencies import require_module, require_program
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme
from gradq.server.process import free_port, spawn_aggregator

yaml = require_module("yaml", "dev")

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
INSTALL = "bash deploy/monitoring/install-prometheus.sh"
WAIT_S = 60.0  # any one condition: generous on 2 busy cores
PACE_S = 0.1  # between the training job's rounds: it keeps training without taking the machine
ROUND_TIMEOUT_S = 2  # the aggregator's --round-timeout: how long the failed round takes to fail

# Series Prometheus adds for every target it scrapes, and the labels it gives every series of a target (a series
# with a `job` of its own, as every gradq_* one has, keeps it: honor_labels).
PER_TARGET_SERIES = {"up"}
TARGET_LABELS = {"instance", "job"}
# What Grafana puts in place of its own variables and the dashboard's when the test runs a panel's query.
GRAFANA_VALUES = {"instance": ".*", "job": ".*", "__rate_interval": "1m", "__range": "1h"}

# One host of the elastic job: it joins, says so once the aggregator watches it (its Watch stream has answered),
# then waits to be killed, which is how a host is lost: its stream ends without a Leave.
_ELASTIC_HOST = """
import sys, time
from gradq.client import JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig, Scheme
spec = JobSpec(world_size=2, elastic=True)
host = WorkerClient(sys.argv[1], "elastic", ANY_RANK, spec, QuantConfig(scheme=Scheme.FLOAT32))
host.join()
deadline = time.monotonic() + 60
while host.membership.world is None:
    if time.monotonic() > deadline:
        sys.exit("no Watch answer within 60 s")
    time.sleep(0.01)
print("watched", flush=True)
sys.stdin.read()
"""


def alert_rules() -> dict[str, dict[str, Any]]:
    """Alert name -> its rule in gradq-alerts.yml."""
    groups = yaml.safe_load((MONITORING / "gradq-alerts.yml").read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def promtool(*arguments: str) -> str:
    """Run promtool in deploy/monitoring and return what it printed; fail showing it when it exits non-zero."""
    command = [require_program("promtool", install=INSTALL), *arguments]
    done = subprocess.run(command, cwd=MONITORING, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(arguments)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


# -- promtool -----------------------------------------------------------------------------------------------------


def test_promtool_accepts_the_scrape_config_and_the_alert_rules() -> None:
    rules = alert_rules()
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", "gradq-alerts.yml")
    for name, rule in rules.items():
        assert rule.get("for"), f"alert {name} has no `for:`"
        assert rule["labels"].get("severity") in ("warning", "critical"), f"alert {name}: severity {rule['labels']}"
        assert "$labels." in rule["annotations"]["description"], f"alert {name}: its description names no label"


def test_every_alert_fires_in_the_rule_unit_tests() -> None:
    assert "SUCCESS" in promtool("test", "rules", "gradq-alerts.test.yml")
    tests = yaml.safe_load((MONITORING / "gradq-alerts.test.yml").read_text())["tests"]
    fired = {check["alertname"] for test in tests for check in test["alert_rule_test"] if check["exp_alerts"]}
    assert fired == set(alert_rules())


# -- the dashboard as Grafana reads it ----------------------------------------------------------------------------


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", ())


def test_the_dashboard_is_one_grafana_imports_and_lays_out() -> None:
    board = dashboard()
    variables = {variable["name"] for variable in board["templating"]["list"]}
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(board):
        place = panel["gridPos"]
        assert place["x"] + place["w"] <= 24, f"panel {panel['title']!r} is wider than the dashboard: {place}"
        for x in range(place["x"], place["x"] + place["w"]):
            for y in range(place["y"], place["y"] + place["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]!r} and {panel['title']!r} overlap at {(x, y)}"
                cells[(x, y)] = panel["title"]
        targets = panel.get("targets", [])
        assert len({target["refId"] for target in targets}) == len(targets), f"{panel['title']!r}: refIds repeat"
        for target in targets:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= variables | set(GRAFANA_VALUES), f"{panel['title']!r} uses undefined {used - variables}"
    assert {"datasource", "instance", "job"} <= variables


# -- a live aggregator --------------------------------------------------------------------------------------------


class Training:
    """Job 'train': two ranks push a round together, every PACE_S, until stopped (in a thread of its own)."""

    def __init__(self, address: str) -> None:
        self.clients = [WorkerClient(address, "train", rank, 2, QuantConfig(bits=8)) for rank in range(2)]
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, name="training", daemon=True)
        self._thread.start()

    def _train(self) -> None:
        gradient = np.random.default_rng(0).normal(size=4096).astype(np.float32)
        try:
            with ThreadPoolExecutor(2) as ranks:
                list(ranks.map(WorkerClient.join, self.clients))
                while not self._stop.wait(PACE_S):
                    list(ranks.map(lambda client: client.push_pull(self.steps, 0, gradient), self.clients))
                    self.steps += 1
        except BaseException as error:  # raised by stop(), in the test's thread
            self.error = error

    @property
    def training(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT_S)
        for client in self.clients:
            client.close()
        if self.error is not None:
            raise self.error


@dataclass
class LiveAggregator:
    """A `gradq serve` that ran a job of each kind; its fixed job still trains."""

    metrics_port: int
    training: Training


def fail_a_round(address: str) -> None:
    """Job 'lonely': rank 0 of 2 pushes alone, so its round fails at the deadline."""
    with WorkerClient(address, "lonely", 0, 2, QuantConfig(bits=8)) as client, pytest.raises(AggregationError):
        client.push_pull(0, 0, np.ones(64, np.float32))


def lose_a_host(address: str, logs: Path) -> WorkerClient:
    """Form elastic job 'elastic' of two hosts and lose one (its process killed); the member left is returned."""
    with (logs / "elastic-host.log").open("w") as log:
        lost = subprocess.Popen(
            [sys.executable, "-c", _ELASTIC_HOST, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
        )
    try:
        member = WorkerClient(
            address, "elastic", ANY_RANK, JobSpec(world_size=2, elastic=True), QuantConfig(scheme=Scheme.FLOAT32)
        )
        member.join()
        assert lost.stdout is not None
        assert lost.stdout.readline() == b"watched\n", f"the elastic host exited {lost.poll()}; see {logs}"
    finally:
        lost.kill()
        lost.wait()
    return member


@pytest.fixture(scope="module")
def aggregator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveAggregator]:
    """A `gradq serve` with --metrics-port that ran three jobs: 'train' (still training), 'lonely' (a round failed
    at the deadline) and 'elastic' (a host lost)."""
    logs = tmp_path_factory.mktemp("aggregator")
    metrics_port = free_port()
    flags = ("--metrics-port", str(metrics_port), "--world-size", "2", "--round-timeout", str(ROUND_TIMEOUT_S))
    with (logs / "gradq-serve.log").open("w") as log:
        server, port = spawn_aggregator(*flags, "--grace", "1", stderr=log)
    address = f"127.0.0.1:{port}"
    training = Training(address)
    try:
        with ThreadPoolExecutor(1) as background:
            failing = background.submit(fail_a_round, address)
            member = lose_a_host(address, logs)
            failing.result(timeout=WAIT_S)
        # Every series a check reads exists once the training job has finished rounds (a busy machine may be slow).
        wait_until(lambda: training.steps >= 2 or not training.training, "the training job's first rounds", WAIT_S)
        assert training.training, f"the training job stopped: {training.error!r}"
        try:
            yield LiveAggregator(metrics_port, training)
        finally:
            member.close()
    finally:
        try:
            training.stop()
        finally:
            server.terminate()
            server.wait(timeout=WAIT_S)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


# -- a real Prometheus --------------------------------------------------------------------------------------------


class PrometheusApi:
    """The HTTP API of a Prometheus on 127.0.0.1."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:  # not listening yet, or 503 while it starts
            return False

    def get(self, path: str, **parameters: str) -> Any:
        """The `data` of a GET; fails naming Prometheus's error (a query it cannot parse, say)."""
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(parameters)}", timeout=5) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"GET {path} {parameters}: HTTP {error.code}: {error.read().decode()}") from error
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=promql)["result"])

    def active_alerts(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(alert name, job) -> the alert, for those pending or firing."""
        alerts = self.get("/api/v1/alerts")["alerts"]
        return {(alert["labels"]["alertname"], alert["labels"].get("job", "")): alert for alert in alerts}


@pytest.fixture
def prometheus(aggregator: LiveAggregator, tmp_path: Path) -> Iterator[PrometheusApi]:
    """A real Prometheus scraping the aggregator every second with deploy/monitoring's config and alert rules."""
    program = require_program("prometheus", install=INSTALL)
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(MONITORING / "gradq-alerts.yml")]
    (scrape_config,) = config["scrape_configs"]
    scrape_config["static_configs"] = [{"targets": [f"127.0.0.1:{aggregator.metrics_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        program,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with (tmp_path / "prometheus.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    api = PrometheusApi(port)
    try:
        wait_until(
            lambda: process.poll() is None and api.ready(), f"prometheus to be ready (log in {tmp_path})", WAIT_S
        )
        yield api
    finally:
        process.terminate()
        process.wait(timeout=WAIT_S)


@pytest.mark.e2e
def test_a_real_prometheus_reads_the_training_job_back_and_raises_its_alerts(
    aggregator: LiveAggregator, prometheus: PrometheusApi
) -> None:
    completed = 'gradq_rounds_total{job="train", outcome="completed"} > 0'
    (series,) = wait_until(lambda: prometheus.query(completed), "a scrape with the job's completed rounds", WAIT_S)
    assert series["metric"]["instance"] == f"127.0.0.1:{aggregator.metrics_port}"
    assert float(series["value"][1]) > 0
    assert aggregator.training.training  # it was read back while the job trained
    assert prometheus.query('sum(gradq_compression_ratio{job="train"}) > 3')  # 8 bits: ~3.8x fp32

    expected = {("GradqJobLostHost", "elastic"), ("GradqRoundsFailing", "lonely")}
    wait_until(lambda: prometheus.active_alerts().keys() >= expected, f"alerts {expected} pending or firing", WAIT_S)
    alerts = prometheus.active_alerts()  # they stay active for minutes: their windows are 5 and 10
    assert alerts[("GradqRoundsFailing", "lonely")]["labels"]["reason"] == "deadline"
    assert {name for name, _ in alerts} == {name for name, _ in expected}, "nothing restarted and no shard is down"

    rules = [rule for group in prometheus.get("/api/v1/rules")["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in rules} == set(alert_rules())
    assert all(rule["health"] == "ok" for rule in rules), [(rule["name"], rule.get("lastError")) for rule in rules]

    for query in dashboard_queries(dashboard()):  # each one a query Prometheus runs
        prometheus.query(re.sub(r"\$\{?(\w+)\}?", lambda variable: GRAFANA_VALUES[variable[1]], query.expr))
    (shard,) = prometheus.query('up{job="gradq"}')  # the dashboard's shards and jobs variables list this one
    assert shard["metric"]["instance"] == f"127.0.0.1:{aggregator.metrics_port}"
    jobs = {series["metric"]["job"] for series in prometheus.query("gradq_rounds_total")}
    assert jobs == {"train", "lonely"}


# -- every query names what gradq exports -------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """A PromQL expression of the dashboard or the alerts, and labels its results must carry."""

    where: str  # for messages: the alert, the panel, the variable
    expr: str
    labels: tuple[str, ...] = ()  # named by a legend, an annotation or a variable's label_values


_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
_AGGREGATIONS |= {"quantile"}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "atan2"}
_TOKEN = re.compile(
    r"""(?P<skip>\s+|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`|\[[^\]]*\]|\$\{?\w+\}?|\d[\w.]*|[-+*/%^@<>!=~]+)"""
    r"|(?P<name>[A-Za-z_:][\w:]*)|(?P<punct>[{}(),])|(?P<other>.)"
)
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", flags=re.DOTALL)


def promql_names(expr: str) -> dict[str, set[str]]:
    """Metric name -> the labels an expression names on it.

    A label of a selector's matchers belongs to its metric; a label of `by`, `without`, `on`, `ignoring` or
    `group_*` to every metric inside the parentheses that hold it (stricter than PromQL, never looser). Strings,
    ranges, numbers, durations, Grafana's variables, functions and keywords are no names.
    """
    tokens = [(match.lastgroup, match.group()) for match in _TOKEN.finditer(expr) if match.lastgroup != "skip"]
    named: dict[str, set[str]] = {}
    scopes: list[tuple[list[str], set[str]]] = [([], set())]  # per open parenthesis: metrics inside, grouping labels

    def close_scope() -> None:
        metrics, labels = scopes.pop()
        for metric in metrics:
            named[metric] |= labels
        if scopes:
            scopes[-1][0].extend(metrics)

    at = 0
    while at < len(tokens):
        kind, text = tokens[at]
        following = tokens[at + 1][1] if at + 1 < len(tokens) else ""
        at += 1
        if kind == "other" or text == "{":
            raise ValueError(f"cannot read {text!r} in {expr!r} (a selector needs a metric name)")
        if text == "(":
            scopes.append(([], set()))
        elif text == ")":
            close_scope()
        elif kind == "punct":
            continue
        elif text in _GROUPING:
            if following == "(":
                end = next(index for index in range(at, len(tokens)) if tokens[index][1] == ")")
                scopes[-1][1].update(name for token, name in tokens[at + 1 : end] if token == "name")
                at = end + 1
        elif following == "(" or text in _KEYWORDS or (text in _AGGREGATIONS and following in _GROUPING):
            continue  # a function, a keyword, an aggregation followed by its grouping
        else:
            labels = named.setdefault(text, set())
            scopes[-1][0].append(text)
            if following == "{":
                end = next(index for index in range(at, len(tokens)) if tokens[index][1] == "}")
                labels.update(name for token, name in tokens[at + 1 : end] if token == "name")
                at = end + 1
    close_scope()
    return named


def dashboard_queries(board: dict[str, Any]) -> list[Query]:
    """Every panel's query with the labels its legend names, and every variable's label_values query."""
    queries = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            legend = tuple(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            queries.append(Query(f"panel {panel['title']!r} {target['refId']}", target["expr"], legend))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found = _LABEL_VALUES.match(variable["query"]["query"])
            assert found, f"variable {variable['name']}: expected label_values(<selector>, <label>)"
            queries.append(Query(f"variable {variable['name']}", found[1], (found[2],)))
    return queries


def alert_queries() -> list[Query]:
    """Every alert's expression with the labels its annotations name."""
    return [
        Query(f"alert {name}", rule["expr"], tuple(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"]))))
        for name, rule in alert_rules().items()
    ]


def exported_names(metrics_text: str) -> dict[str, set[str]]:
    """Sample name (`gradq_rounds_total`, `gradq_round_seconds_bucket`, ...) -> its labels as Prometheus stores it."""
    exported = {name: set(TARGET_LABELS) for name in PER_TARGET_SERIES}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            exported.setdefault(sample.name, set(TARGET_LABELS)).update(sample.labels)
    return exported


def unknown_names(queries: Iterable[Query], exported: dict[str, set[str]]) -> list[str]:
    """What the queries name that the metrics do not have: one line each."""
    problems = []
    for query in queries:
        for metric, labels in promql_names(query.expr).items():
            if metric not in exported:
                problems.append(f"{query.where}: no metric {metric} in /metrics ({query.expr.strip()})")
            for label in sorted((labels | set(query.labels)) - exported.get(metric, labels | set(query.labels))):
                problems.append(f"{query.where}: {metric} has no label {label} ({query.expr.strip()})")
    return problems


def test_every_query_names_only_metrics_and_labels_a_live_aggregator_exports(aggregator: LiveAggregator) -> None:
    exported = exported_names(scrape(aggregator.metrics_port))
    queries = [*alert_queries(), *dashboard_queries(dashboard())]
    problems = unknown_names(queries, exported)
    assert not problems, "\n".join(problems)
    named = {metric for query in queries for metric in promql_names(query.expr)}
    families = {family.name for family in text_string_to_metric_families(scrape(aggregator.metrics_port))}
    shown = {family for family in families if family.startswith("gradq_") and not family.endswith("_created")}
    unshown = {
        family
        for family in shown
        if not any(re.fullmatch(rf"{family}(_total|_bucket|_sum|_count)?", name) for name in named)
    }
    assert not unshown, f"gradq exports {sorted(unshown)}, which no query of the dashboard or the alerts shows"


@pytest.mark.parametrize(
    ("query", "unknown"),
    [
        ("sum by (job) (rate(gradq_round_total[5m]))", "no metric gradq_round_total"),
        ('gradq_rounds_total{outcom="failed"}', "gradq_rounds_total has no label outcom"),
        ("sum by (shard) (rate(gradq_contributions_total[5m]))", "gradq_contributions_total has no label shard"),
        ("histogram_quantile(0.9, rate(gradq_round_seconds[5m]))", "no metric gradq_round_seconds"),  # _bucket
        ('gradq_slowest_rank{rank="0"}', "gradq_slowest_rank has no label rank"),  # only the _rounds_total has it
        ('sum(up{job="gradq"}) by (shard)', "up has no label shard"),
    ],
)
def test_the_check_names_a_metric_or_label_the_aggregator_lacks(
    aggregator: LiveAggregator, query: str, unknown: str
) -> None:
    exported = exported_names(scrape(aggregator.metrics_port))
    (problem,) = unknown_names([Query("by hand", query)], exported)
    assert unknown in problem


def test_the_query_reader_finds_metrics_labels_and_legends() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, job) (rate(gradq_round_seconds_bucket{instance=~"$instance"}[$__rate_'
        "interval]))) / on (job) group_left sum(gradq_job_members offset 5m) by (job) > bool 0 or vector(1)"
    )
    assert promql_names(expr) == {"gradq_round_seconds_bucket": {"le", "job", "instance"}, "gradq_job_members": {"job"}}
    (variable,) = [query for query in dashboard_queries(dashboard()) if query.where == "variable job"]
    assert variable.labels == ("job",) and set(promql_names(variable.expr)) == {"gradq_rounds_total"}
