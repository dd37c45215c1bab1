"""deploy/kubernetes: `kubectl kustomize` builds it, every object validates against Kubernetes 1.32's schema, and its
ports, probes, images, commands and GRADQ_* variables are the ones gradq serve, torchrun and the Dockerfile use.

Offline: no cluster runs here (docs/kubernetes.md says so). The validator is kubernetes-validate (the dev extra),
which bundles each Kubernetes version's OpenAPI schema as JSON schemas; strict mode refuses unknown fields. The
ServiceMonitor is a Prometheus Operator custom resource with no schema there: its fields are checked by hand below.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from dependencies import require_module, require_program

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes"
# The Kubernetes version the manifests are validated against (docs/kubernetes.md names it; kubectl here is 1.32).
KUBERNETES_VERSION = "1.32"
# What a shard's process holds outside --max-memory-bytes (docs/operating.md: Python, numpy, gRPC and numba's
# kernels, about 241 MB, and the free heap glibc keeps for gRPC's buffers, up to 256 MiB).
PROCESS_FOOTPRINT_BYTES = 512 * 2**20
# The duration pattern of the ServiceMonitor CRD's `interval` (Prometheus's durations).
_DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
# The ServiceMonitor fields these manifests may use (monitoring.coreos.com/v1; the CRD allows more).
_MONITOR_SPEC_FIELDS = {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels"}
_MONITOR_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
_QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
# A variable in a command or args: the kubelet expands $(NAME) from the container's env.
_REFERENCE = re.compile(r"\$\((\w+)\)")
_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

Object = dict[str, Any]


@pytest.fixture(scope="module")
def objects() -> list[Object]:
    """Every object `kubectl kustomize deploy/kubernetes` renders."""
    kubectl = require_program("kubectl", install="install kubectl (1.32 or later: it has kustomize built in)")
    yaml = require_module("yaml", "dev")
    built = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, f"kubectl kustomize {BASE.relative_to(REPO)} failed: {built.stderr}"
    return [item for item in yaml.safe_load_all(built.stdout) if item]


def _one(objects: list[Object], kind: str, name: str | None = None) -> Object:
    found = [item for item in objects if item["kind"] == kind and name in (None, item["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[item['metadata']['name'] for item in found]}"
    return found[0]


def _container(workload: Object) -> Object:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['kind']} {workload['metadata']['name']}: expected one container"
    return dict(containers[0])


def _literal_env(container: Object) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def _port(container: Object, name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    assert name in ports, f"container {container['name']}: no port named {name!r} (has {sorted(ports)})"
    return int(ports[name])


def _quantity(text: str) -> float:
    match = _QUANTITY.match(str(text))
    assert match, f"{text!r} is not a quantity this test reads"
    return float(match.group(1)) * _UNITS[match.group(2)]


def _headless_service_of(objects: list[Object], name: str, pod_labels: dict[str, str]) -> Object:
    """The Service ``name``, checked to be headless and to select the pods labelled ``pod_labels``."""
    service = _one(objects, "Service", name)
    assert service["spec"].get("clusterIP") == "None", f"Service {name} must be headless (clusterIP: None)"
    selector = service["spec"]["selector"]
    assert selector.items() <= pod_labels.items(), f"Service {name} selects {selector}; the pods are {pod_labels}"
    return service


def _service_port(service: Object, name: str, container: Object) -> int:
    """The Service's port ``name``, checked to reach the container's port of that name at the same number."""
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert name in ports, f"Service {service['metadata']['name']}: no port {name!r}"
    target = ports[name].get("targetPort", ports[name]["port"])
    number = _port(container, target) if isinstance(target, str) else target
    assert number == ports[name]["port"] == _port(container, name), (
        f"Service {service['metadata']['name']} port {name}: {ports[name]} does not reach container port "
        f"{name}={_port(container, name)} at the same number"
    )
    return int(number)


def _command_in_pod(container: Object, index: int) -> list[str]:
    """The container's command as the kubelet runs it in pod ``index`` of an indexed Job.

    Each $(NAME) is expanded from the container's variables, the completion index from the pod's annotation.
    """
    values = _literal_env(container)
    for item in container.get("env", []):
        if item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == _COMPLETION_INDEX:
            values[item["name"]] = str(index)
    command = [str(part) for part in container["command"]]
    unresolved = sorted({name for part in command for name in _REFERENCE.findall(part)} - set(values))
    assert not unresolved, f"the command refers to variables the container does not define: {unresolved}"
    return [_REFERENCE.sub(lambda reference: values[reference.group(1)], part) for part in command]


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """os.environ with no GRADQ_* variable but ``variables``: what a container's process sees of them."""
    kept = {name: value for name, value in os.environ.items() if not name.startswith("GRADQ_")}
    with mock.patch.dict(os.environ, {**kept, **variables}, clear=True):
        yield


def _serve_arguments(container: Object) -> Any:
    """The container's args and env as `gradq serve` itself parses them (its parser, its defaults)."""
    from gradq.server.cli import build_parser

    with _environment(_literal_env(container)):
        parser = build_parser()
        try:
            return parser.parse_args(container.get("args", []))
        except SystemExit:
            pytest.fail(f"gradq serve refuses the aggregator's args {container.get('args')} (its error is above)")


def _dockerfile() -> tuple[Path, dict[str, list[str]]]:
    """compose.yaml's Dockerfile and its stages: name -> instructions (continuation lines joined)."""
    yaml = require_module("yaml", "dev")
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    names = {service["build"]["dockerfile"] for service in compose["services"].values() if "build" in service}
    assert len(names) == 1, f"compose.yaml builds from {names}; expected one Dockerfile"
    path = REPO / names.pop()
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in path.read_text().replace("\\\n", " ").splitlines():
        stage = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, flags=re.IGNORECASE)
        if stage:
            current = stages.setdefault(stage.group(1), [])
        current.append(line)
    return path, stages


def _instruction(stage: list[str], keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.upper().startswith(keyword + " ")]


def _compose_targets() -> dict[str, str]:
    """Image -> the Dockerfile target compose.yaml builds it from."""
    yaml = require_module("yaml", "dev")
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"].values()
    return {service["image"]: service["build"]["target"] for service in services if "build" in service}


def test_every_object_validates_against_the_kubernetes_schema(objects: list[Object]) -> None:
    validator = require_module("kubernetes_validate", "dev")
    kinds = sorted(f"{item['kind']}/{item['metadata']['name']}" for item in objects)
    assert kinds == [
        "ConfigMap/" + _one(objects, "ConfigMap")["metadata"]["name"],
        "Job/gradq-train",
        "PodDisruptionBudget/gradq",
        "Service/gradq",
        "Service/gradq-train",
        "ServiceMonitor/gradq",
        "StatefulSet/gradq",
    ]
    unchecked = []
    for item in objects:
        name = f"{item['kind']} {item['metadata']['name']}"
        try:
            checked = validator.validate(item, KUBERNETES_VERSION, strict=True)
        except validator.SchemaNotFoundError:
            unchecked.append(item["kind"])
            continue
        except validator.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name} is not a valid Kubernetes {error.version} object: {path}: {error.message}")
        assert checked == KUBERNETES_VERSION, f"{name} was checked against {checked}, not {KUBERNETES_VERSION}"
    assert unchecked == ["ServiceMonitor"], f"objects no bundled schema covers: {unchecked}"


def test_the_service_monitor_scrapes_every_shards_metrics_port(objects: list[Object]) -> None:
    validator = require_module("kubernetes_validate", "dev")
    monitor = _one(objects, "ServiceMonitor", "gradq")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}, sorted(monitor)
    assert set(monitor["spec"]) <= _MONITOR_SPEC_FIELDS, f"unchecked ServiceMonitor fields: {sorted(monitor['spec'])}"
    # Its metadata and selector are Kubernetes' own types (ObjectMeta, LabelSelector): a PodDisruptionBudget of
    # them validates them against the same schema as everything else.
    carrier = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": monitor["metadata"],
        "spec": {"selector": monitor["spec"]["selector"]},
    }
    validator.validate(carrier, KUBERNETES_VERSION, strict=True)
    service = _one(objects, "Service", "gradq")
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items(), (
        f"the ServiceMonitor selects {selected}; Service gradq is labelled {service['metadata']['labels']}"
    )
    aggregator = _container(_one(objects, "StatefulSet", "gradq"))
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= _MONITOR_ENDPOINT_FIELDS, f"unchecked endpoint fields: {sorted(endpoint)}"
    assert _service_port(service, endpoint["port"], aggregator) == _serve_arguments(aggregator).metrics_port
    assert endpoint["path"] == "/metrics"
    assert _DURATION.match(endpoint["interval"]), f"interval {endpoint['interval']!r} is not a Prometheus duration"
    # gradq's series carry a `job` label of their own (the training job), which Prometheus would otherwise rename.
    assert endpoint["honorLabels"] is True


def test_the_shards_listen_and_are_probed_where_gradq_serve_serves(objects: list[Object]) -> None:
    from gradq.server.cli import build_parser

    with _environment({}):
        default_port = build_parser().get_default("port")
    shards = _one(objects, "StatefulSet", "gradq")
    aggregator = _container(shards)
    served = _serve_arguments(aggregator)
    assert served.port == default_port == _port(aggregator, "grpc"), (
        f"gradq serve listens on {served.port} (default {default_port}); the container port grpc is "
        f"{_port(aggregator, 'grpc')}"
    )
    assert served.metrics_port == _port(aggregator, "metrics"), (
        f"gradq serve serves /metrics on {served.metrics_port}; the container port metrics is "
        f"{_port(aggregator, 'metrics')}"
    )
    for probe in ("readinessProbe", "livenessProbe"):
        grpc_probe = aggregator[probe].get("grpc")
        assert grpc_probe is not None, f"the {probe} must be a native gRPC probe"
        assert grpc_probe["port"] == served.port, f"the {probe} asks port {grpc_probe['port']}, not {served.port}"
        # gradq serve sets the whole server's health, service "", SERVING once it serves.
        assert grpc_probe.get("service", "") == "", f"the {probe} asks service {grpc_probe['service']!r}"
    grace = shards["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > served.grace + 2, f"terminationGracePeriodSeconds {grace} must exceed --grace + 2 ({served.grace})"
    limit = _quantity(aggregator["resources"]["limits"]["memory"])
    assert served.max_memory_bytes + PROCESS_FOOTPRINT_BYTES <= limit, (
        f"--max-memory-bytes {served.max_memory_bytes} + the process's {PROCESS_FOOTPRINT_BYTES} must fit the "
        f"memory limit {aggregator['resources']['limits']['memory']}"
    )
    pdb = _one(objects, "PodDisruptionBudget", "gradq")
    pod_labels = shards["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_aggregator_flags_are_in_gradq_serve_help(objects: list[Object]) -> None:
    aggregator = _container(_one(objects, "StatefulSet", "gradq"))
    shown = subprocess.run(
        [sys.executable, "-m", "gradq.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    flags = {argument.split("=", 1)[0] for argument in aggregator.get("args", []) if argument.startswith("--")}
    missing = sorted(flag for flag in flags if not re.search(rf"(^|\s){re.escape(flag)}\b", shown.stdout))
    assert flags and not missing, f"flags that `gradq serve --help` does not list: {missing}"


def test_every_gradq_variable_is_one_its_process_reads(objects: list[Object]) -> None:
    from gradq.client.env import HOOK_ENVIRONMENT, hook_arguments_from_env
    from gradq.server.env import SERVE_ENVIRONMENT, read_variable

    aggregator = _container(_one(objects, "StatefulSet", "gradq"))
    worker = _container(_one(objects, "Job", "gradq-train"))
    for container, known in ((aggregator, SERVE_ENVIRONMENT), (worker, HOOK_ENVIRONMENT)):
        names = [item["name"] for item in container.get("env", []) if item["name"].startswith("GRADQ_")]
        unknown = sorted(set(names) - set(known))
        assert names and not unknown, f"container {container['name']} sets variables its process never reads: {unknown}"
    for name, value in _literal_env(aggregator).items():
        if name.startswith("GRADQ_"):
            read_variable({name: value}, name)  # raises naming the variable if gradq serve would refuse it
    hook_arguments_from_env(_literal_env(worker))  # likewise for the worker's hook


def test_the_images_are_the_dockerfile_targets_as_compose_tags_them(objects: list[Object]) -> None:
    path, stages = _dockerfile()
    targets = _compose_targets()
    aggregator = _container(_one(objects, "StatefulSet", "gradq"))
    worker = _container(_one(objects, "Job", "gradq-train"))
    for container, target in ((aggregator, "aggregator"), (worker, "worker")):
        assert targets.get(container["image"]) == target, (
            f"container {container['name']} runs {container['image']}; compose.yaml tags target {target} as "
            f"{[image for image, built in targets.items() if built == target]}"
        )
        assert target in stages, f"{path.relative_to(REPO)} has no stage {target}"
    kustomization = require_module("yaml", "dev").safe_load((BASE / "kustomization.yaml").read_text())
    named = {image["name"] for image in kustomization["images"]}
    assert named == {container["image"].split(":")[0] for container in (aggregator, worker)}, (
        f"kustomization.yaml's images {sorted(named)} are not the ones the containers run"
    )
    # The aggregator runs the image's ENTRYPOINT (gradq serve) with the args checked above; EXPOSE names its ports.
    assert "command" not in aggregator
    assert [json.loads(entry) for entry in _instruction(stages["aggregator"], "ENTRYPOINT")] == [["gradq", "serve"]]
    exposed = {int(port) for entry in _instruction(stages["aggregator"], "EXPOSE") for port in entry.split()}
    assert {_port(aggregator, "grpc"), _port(aggregator, "metrics")} <= exposed, f"EXPOSE {exposed}"
    # The worker replaces the ENTRYPOINT with torchrun: a console script of torch, which the worker target's extra
    # installs (the stage it copies its environment from runs pip install "/src[EXTRA]").
    assert worker["command"][0] == "torchrun"
    require_module("torch", "torch")
    (source,) = [line.split("--from=")[1].split()[0] for line in stages["worker"] if "--from=" in line]
    extras = re.findall(r"/src\[([\w,]+)\]", " ".join(stages[source]))
    assert extras, f"stage {source} installs gradq without an extra"
    requirements = importlib.metadata.requires("gradq") or []
    installed = {
        re.split(r"[<>=!~ ;\[]", requirement)[0]
        for requirement in requirements
        if any(f'extra == "{extra}"' in requirement for extra in extras[0].split(","))
    }
    assert "torch" in installed, f"the worker target installs gradq[{extras[0]}], which brings {sorted(installed)}"
    scripts = importlib.metadata.entry_points(group="console_scripts", name="torchrun")
    assert [script.dist.name for script in scripts if script.dist is not None] == ["torch"]


def test_the_workers_find_every_shard_and_node_zero(objects: list[Object]) -> None:
    require_module("torch", "torch")
    from torch.distributed.run import get_args_parser

    from gradq.client.env import read_variable

    shards = _one(objects, "StatefulSet", "gradq")
    served = _serve_arguments(_container(shards))
    shard_labels = shards["spec"]["template"]["metadata"]["labels"]
    _headless_service_of(objects, shards["spec"]["serviceName"], shard_labels)
    job = _one(objects, "Job", "gradq-train")
    worker = _container(job)
    expected = [
        f"{shards['metadata']['name']}-{k}.{shards['spec']['serviceName']}:{served.port}"
        for k in range(shards["spec"]["replicas"])
    ]
    aggregators = read_variable(_literal_env(worker), "GRADQ_AGGREGATORS")
    assert aggregators == expected, f"GRADQ_AGGREGATORS names {aggregators}; the shards are {expected}, in order"

    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"], "every node must run at once"
    service = _headless_service_of(objects, pod["subdomain"], spec["template"]["metadata"]["labels"])
    assert service["spec"].get("publishNotReadyAddresses") is True
    rendezvous_port = _service_port(service, "rendezvous", worker)
    parser = get_args_parser()
    for index in range(spec["completions"]):
        command = _command_in_pod(worker, index)
        try:
            launch = parser.parse_args(command[1:])
        except SystemExit:
            pytest.fail(f"torchrun refuses {command} (its error is above)")
        assert int(launch.nnodes) == spec["completions"], f"--nnodes {launch.nnodes}, {spec['completions']} pods"
        assert launch.node_rank == index, f"pod {index} runs as node {launch.node_rank}"
        # An indexed Job's pod k is named <job>-k, and resolves as <job>-k.<subdomain>.
        assert launch.master_addr == f"{job['metadata']['name']}-0.{pod['subdomain']}"
        assert launch.master_port == rendezvous_port
        assert launch.rdzv_backend == "static"

    mounts = {mount["name"]: mount["mountPath"] for mount in worker["volumeMounts"]}
    script = Path(launch.training_script)
    (volume,) = [volume for volume in pod["volumes"] if mounts.get(volume["name"]) == str(script.parent)]
    config_map = _one(objects, "ConfigMap", volume["configMap"]["name"])
    assert config_map["data"].get(script.name) == (REPO / "examples" / "torchrun_train.py").read_text(), (
        f"{script} is not examples/torchrun_train.py"
    )


def test_the_docs_state_the_version_and_that_nothing_ran_on_a_cluster() -> None:
    page = " ".join((REPO / "docs" / "kubernetes.md").read_text().split())  # the words, whatever the line breaks
    assert f"Kubernetes {KUBERNETES_VERSION}" in page
    assert "validated offline, not run on a cluster" in page
    assert "kubectl apply -k deploy/kubernetes" in page
