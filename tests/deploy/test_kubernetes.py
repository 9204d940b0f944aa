"""deploy/kubernetes: every overlay renders, validates offline against the Kubernetes API schemas, and agrees
with the server it runs (port, /health, shutdown grace, where the weights come from)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kustomize_lite import render

from oai_gemma.api.app import create_app
from oai_gemma.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "gpu-dummy")
K8S_VERSION = "1.32"
UVICORN_CLOSE_S = 5
"""cli.py's `timeout_graceful_shutdown`: after the drain, uvicorn's own wait for connections to close."""


def rendered(overlay: str) -> list[dict]:
    """`kubectl kustomize` where kubectl exists (and the small Python renderer must agree), else the renderer."""
    docs = render(KUSTOMIZE / "overlays" / overlay)
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True, text=True, check=True)
        official = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert _normal(official) == _normal(docs)
        return official
    return docs


def _normal(docs: list[dict]):
    """Order-free form: documents by kind and name, lists of named maps by name (Kustomize reorders those)."""

    def norm(x):
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list) and all(isinstance(i, dict) and "name" in i for i in x):
            return sorted((norm(i) for i in x), key=lambda i: i["name"])
        return [norm(i) for i in x] if isinstance(x, list) else x

    return sorted((norm(d) for d in docs), key=lambda d: (d["kind"], d["metadata"]["name"]))


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def server_container(docs: list[dict]) -> dict:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def container_settings(container: dict):
    """The settings the server in this container would run with: its --config file and its env, read by the
    server's own loader."""
    args = container["args"]
    config = ROOT / args[args.index("--config") + 1]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return load_settings(config, environ=env), env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_the_kubernetes_schemas(overlay):
    docs = rendered(overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    doc = one(rendered("cpu"), "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_ports_point_at_the_servers_health_route(overlay):
    docs = rendered(overlay)
    container = server_container(docs)
    settings, _ = container_settings(container)
    (port,) = container["ports"]
    assert port["containerPort"] == settings.server.port and settings.server.host == "0.0.0.0"
    routes = {route.path for route in create_app(settings).routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == port["name"] and get["path"] in routes and get["path"] == "/health"
    assert not settings.server.health_requires_key  # kubelet probes send no key
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.server.port and annotations["prometheus.io/path"] in routes
    assert not settings.server.metrics_requires_key and settings.server.metrics_vllm_names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_match_the_servers_drain(overlay):
    docs = rendered(overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = server_container(docs)
    settings, _ = container_settings(container)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = int(command[1])
    drain = pause + settings.server.shutdown_grace + UVICORN_CLOSE_S
    assert drain <= pod["terminationGracePeriodSeconds"] <= drain + 15
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > pause + settings.server.shutdown_grace  # never kills a drain
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= pause  # out of the endpoints within the pause
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weights_come_from_the_image_or_a_volume_never_the_hub(overlay):
    docs = rendered(overlay)
    container = server_container(docs)
    settings, env = container_settings(container)
    assert env["HF_HUB_OFFLINE"] == "1"
    source = settings.model.source
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    if settings.model.load_format == "dummy":
        assert (ROOT / source / "config.json").is_file()  # a model config the image ships (configs/hf/)
    elif source != "embedded":
        assert any(source.startswith(m + "/") for m in mounts), (source, mounts)
        volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert one(docs, "PersistentVolumeClaim")["metadata"]["name"] == claim


@pytest.mark.parametrize("overlay", ["gpu", "gpu-dummy"])
def test_gpu_overlays_ask_for_a_gpu(overlay):
    container = server_container(rendered(overlay))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    settings, _ = container_settings(container)
    assert settings.model.device.startswith("cuda")


def test_autoscaler_pdb_and_service_select_the_deployments_pods():
    docs = rendered("cpu")
    deployment = one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for doc in (one(docs, "PodDisruptionBudget"), deployment):
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one(docs, "Service")["spec"]["selector"].items() <= labels.items()
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "oai_gemma:num_requests_waiting".replace(":", "_")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
