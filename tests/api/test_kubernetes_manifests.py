"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (kubernetes-validate, strict: an unknown
field is an error), and the Deployment a valid cluster node (the service's own ``Settings`` read its environment, the
secrets from the Secret), with probes, a grace period that covers the drain, and the image's non-root user."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from switchboard.cli.main import GRACEFUL_SHUTDOWN_S
from switchboard.cli.runner import EXIT_GRACE_S
from switchboard.control.settings import Settings
from tests.waiting import WAIT_S

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# the oldest Kubernetes docs/deploy.md names, and the newest kubernetes-validate knows
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SECRET_KEYS = {
    "SWITCHBOARD_DATABASE_URL": "database-url",
    "SWITCHBOARD_REDIS_URL": "redis-url",
    "SWITCHBOARD_CLUSTER_SECRET": "cluster-secret",
    "SWITCHBOARD_TOKEN_SECRET": "token-secret",
    "SWITCHBOARD_API_KEYS": "api-keys",
}
POD = {"metadata.name": "switchboard-7d9f8b6c5-x2k4q", "status.podIP": "10.1.2.3"}


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def errors(resource: dict[str, Any]) -> list[str]:
    found = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            found.append(f"{version}: {err.message} at {'/'.join(map(str, err.path))}")
    return found


def resource(kind: str) -> dict[str, Any]:
    [found] = [d for p in manifest_files() for d in documents(p) if d["kind"] == kind]
    return found


def container(name: str, init: bool = False) -> dict[str, Any]:
    pod = resource("Deployment")["spec"]["template"]["spec"]
    [found] = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    return found


def secret_values() -> dict[str, str]:
    return {k: str(v) for k, v in resource("Secret")["stringData"].items()}


def environment(spec: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet makes it: the Dockerfile's, then its own in order, ``valueFrom`` read
    from the example Secret and the downward API, ``$(VAR)`` replaced by an earlier variable."""
    env = dict(re.findall(r"(SWITCHBOARD_\w+)=(\S+)", (ROOT / "Dockerfile").read_text()))
    secrets = secret_values()
    for var in spec["env"]:
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            assert source["secretKeyRef"]["name"] == "switchboard"
            value = secrets[source["secretKeyRef"]["key"]]
        elif "fieldRef" in source:
            value = POD[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        env[var["name"]] = value
    return env


def settings_of(spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SWITCHBOARD_")]:
            patch.delenv(name)
        for name, value in environment(spec).items():
            patch.setenv(name, value)
        return Settings()


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path):
    docs = documents(path)
    assert docs, path
    for doc in docs:
        assert errors(doc) == [], (path.name, doc["kind"])


def test_the_validation_finds_a_mistake():
    """The check can fail: an unknown field (strict), a wrong type and a missing required field are each reported."""
    deployment = copy.deepcopy(resource("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    assert errors(deployment)
    deployment = copy.deepcopy(resource("Deployment"))
    deployment["spec"]["replicas"] = "three"
    assert errors(deployment)
    service = copy.deepcopy(resource("Service"))
    del service["spec"]["ports"][0]["port"]
    assert errors(service)


def test_the_kustomization_applies_every_manifest_but_the_example_secret():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in manifest_files()} - {"secret.example.yaml"}
    assert [image["name"] for image in kustomization["images"]] == ["switchboard"]
    if shutil.which("kubectl") is None:
        return
    built = subprocess.run(
        ["kubectl", "kustomize", str(MANIFESTS)], capture_output=True, check=True, timeout=WAIT_S
    ).stdout
    for doc in yaml.safe_load_all(built):
        assert errors(doc) == [], doc["kind"]


def test_the_nodes_are_valid_cluster_nodes_whose_credentials_come_from_the_secret(monkeypatch: pytest.MonkeyPatch):
    serve = container("switchboard")
    for var in serve["env"]:
        if var["name"] in SECRET_KEYS:
            assert var["valueFrom"]["secretKeyRef"]["key"] == SECRET_KEYS[var["name"]]
            assert "value" not in var
    assert {v["name"] for v in serve["env"]} >= set(SECRET_KEYS)
    settings = settings_of(serve, monkeypatch)
    settings.check_bind()
    settings.check_cluster()
    assert settings.cluster_mode and settings.auth_enabled and not settings.migrate_on_start
    assert settings.node_id == POD["metadata.name"]
    assert settings.advertise_url == f"http://{POD['status.podIP']}:{settings.port}"
    assert settings.host == "0.0.0.0"
    [port] = serve["ports"]
    assert port == {"name": "http", "containerPort": settings.port}
    # the migration runs first, on the same database, as the image's `switchboard migrate`
    migrate = container("migrate", init=True)
    assert migrate["command"] == ["switchboard", "migrate"] and migrate["image"] == serve["image"]
    assert settings_of(migrate, monkeypatch).database_url == settings.database_url


def test_probes_readiness_on_readyz_liveness_on_healthz():
    serve = container("switchboard")
    assert serve["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert serve["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert serve["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    startup = serve["startupProbe"]
    # a start waits for its database (DATABASE_WAIT_S) before it gives up: the startup probe waits longer
    assert startup["periodSeconds"] * startup["failureThreshold"] > Settings.model_fields["database_wait_s"].default


def test_the_grace_period_covers_the_pre_stop_pause_and_the_whole_drain(monkeypatch: pytest.MonkeyPatch):
    pod = resource("Deployment")["spec"]["template"]["spec"]
    serve = container("switchboard")
    settings = settings_of(serve, monkeypatch)
    command = serve["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause_s = float(command[1])
    needed_s = pause_s + settings.drain_timeout_s + GRACEFUL_SHUTDOWN_S + settings.shutdown_tool_grace_s + EXIT_GRACE_S
    assert pod["terminationGracePeriodSeconds"] >= needed_s + 5, needed_s
    strategy = resource("Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0  # a new node is ready before an old one drains: someone adopts


def test_the_pods_run_as_the_image_user_on_a_read_only_root_with_resources():
    deployment = resource("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert user is not None
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user.group(1))
    for spec in [*pod["initContainers"], *pod["containers"]]:
        context = spec["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(spec["resources"]["requests"]) and "memory" in spec["resources"]["limits"]
    assert deployment["spec"]["replicas"] >= 3


def test_the_service_and_the_budget_select_the_deployments_pods():
    deployment = resource("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = resource("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    budget = resource("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
