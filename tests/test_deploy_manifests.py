"""The Kubernetes manifests in deploy/k8s, checked without a cluster.

Every object is validated against the Kubernetes OpenAPI-derived JSON schemas (the "strict"
ones, which refuse unknown fields) that the PyPI package kubernetes-validate ships, read out of
its wheel: kubeconform is a Go binary on neither PyPI nor Debian. Then the manifests are checked
against the services themselves: commands parse with each Config, probes hit the real health
endpoints and ports, Services select the pods and name their ports, the drain fits the grace.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.jsonschema
import yaml

import detok_worker.config
import gateway.config
import model_worker.config
from tests.schema_wheels import download_pinned_wheel
from tokenwire.config_cli import parse_config

REPO_ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = REPO_ROOT / "deploy" / "k8s"

# Pinned by version and hash, as test_compose.py pins its schema wheel.
SCHEMA_WHEEL = "kubernetes-validate==1.37.0"
SCHEMA_WHEEL_SHA256 = "85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9"
# The oldest and newest Kubernetes the wheel covers that the manifests target (gRPC probes
# are GA since 1.27).
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]

COMMAND_CONFIGS: dict[str, type] = {
    "model_worker": model_worker.config.Config,
    "detok_worker": detok_worker.config.Config,
    "gateway": gateway.config.Config,
}
IMAGE_USER = 10001  # the Dockerfile's USER


@pytest.fixture(scope="session")
def schema_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return download_pinned_wheel(SCHEMA_WHEEL, SCHEMA_WHEEL_SHA256, tmp_path_factory.mktemp("k8s-schemas"))


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="session")
def objects() -> list[dict[str, Any]]:
    docs = []
    for path in manifest_files():
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, "no manifests in deploy/k8s"
    return docs


def schema_name(obj: dict[str, Any]) -> str:
    """kubernetes-json-schema's file name: deployment-apps-v1.json, service-v1.json, ..."""
    group, _, version = obj["apiVersion"].rpartition("/")
    group = group.split(".")[0]
    return f"{obj['kind'].lower()}{'-' + group if group else ''}-{version}.json"


def validator_for(wheel: Path, version: str, name: str) -> jsonschema.protocols.Validator:
    prefix = f"kubernetes_validate/kubernetes-json-schema/v{version}-local-strict/"
    with zipfile.ZipFile(wheel) as archive:
        schema = json.loads(archive.read(prefix + name))
        definitions = json.loads(archive.read(prefix + "_definitions.json"))
    # The schemas point at "/api/_definitions.json#/$defs/..." for every shared type.
    registry = referencing.Registry().with_resource(
        "/api/_definitions.json", referencing.jsonschema.DRAFT202012.create_resource(definitions))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def deployment_for(objects: list[dict[str, Any]], module: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(objects, "Deployment").values() if container(d)["command"][:3] ==
                ["python", "-m", module]]
    return found


def config_of(deployment: dict[str, Any]) -> Any:
    command = container(deployment)["command"]
    return parse_config(COMMAND_CONFIGS[command[2]], command[3:], env_prefix="TOKENWIRE_DEPLOY_TEST_UNSET_")


def container_port(deployment: dict[str, Any], name_or_number: str | int) -> int:
    for port in container(deployment)["ports"]:
        if name_or_number in (port["name"], port["containerPort"]):
            return port["containerPort"]
    raise AssertionError(f"no container port {name_or_number!r}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(schema_wheel: Path, objects, version: str) -> None:
    errors = []
    for obj in objects:
        validator = validator_for(schema_wheel, version, schema_name(obj))
        errors += [f"{obj['kind']}/{obj['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                   for e in validator.iter_errors(obj)]
    assert not errors, "\n".join(errors)


def test_the_schema_check_refuses_a_broken_manifest(schema_wheel: Path, objects) -> None:
    """The validation above has teeth: a misspelt field and a wrong type are both refused."""
    deployment = json.loads(json.dumps(deployment_for(objects, "gateway")))
    deployment["spec"]["replica"] = 2
    container(deployment)["ports"][0]["containerPort"] = "8000"
    validator = validator_for(schema_wheel, KUBERNETES_VERSIONS[-1], "deployment-apps-v1.json")
    messages = " | ".join(e.message for e in validator.iter_errors(deployment))
    assert "replica" in messages and "'8000' is not of type 'integer'" in messages


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]


@pytest.mark.parametrize("module", sorted(COMMAND_CONFIGS))
def test_commands_parse_and_bind_their_container_port(objects, module: str) -> None:
    deployment = deployment_for(objects, module)
    config = config_of(deployment)
    assert config.host == "0.0.0.0", f"{module} must listen beyond the pod's loopback"
    assert container_port(deployment, config.port) == config.port
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = container(deployment).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + config.drain_grace_s + 5, "SIGKILL would cut the drain"
    if module == "gateway":
        # Its listener closes on SIGTERM: the pod serves on until the endpoints have dropped it (review 104).
        assert pre_stop_s >= 5
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == IMAGE_USER
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_model_worker_runs_on_a_gpu(objects) -> None:
    deployment = deployment_for(objects, "model_worker")
    assert config_of(deployment).device == "cuda"
    resources = container(deployment)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a surge pod would wait for a GPU"


def test_detok_workers_scale_on_their_own(objects) -> None:
    detok = deployment_for(objects, "detok_worker")
    assert detok is not deployment_for(objects, "model_worker") and detok["spec"]["replicas"] >= 2
    assert "nvidia.com/gpu" not in json.dumps(container(detok)["resources"])


@pytest.mark.parametrize("module", ["model_worker", "detok_worker"])
def test_worker_probes_are_grpc_health_on_the_service_port(objects, module: str) -> None:
    deployment = deployment_for(objects, module)
    port = config_of(deployment).port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(deployment)[probe]["grpc"]["port"] == port, probe


def test_gateway_probes_are_its_liveness_and_readiness_routes(objects) -> None:
    from gateway.app import create_app

    deployment = deployment_for(objects, "gateway")
    config = config_of(deployment)
    routes = set(create_app(config).openapi()["paths"])
    probes = container(deployment)
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    # /ready waits up to PROBE_TIMEOUT_S for a hung replica's GetLoad: the probe must wait longer
    # (Kubernetes' default of 1 s pulled every gateway pod when one model worker hung).
    from gateway.ops_routes import PROBE_TIMEOUT_S
    for probe in ("readinessProbe", "livenessProbe"):
        assert probes[probe].get("timeoutSeconds", 1) > PROBE_TIMEOUT_S, probe
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = probes[probe]["httpGet"]
        assert get["path"] in routes, f"{probe}: the gateway has no {get['path']}"
        assert container_port(deployment, get["port"]) == config.port


def test_services_select_their_pods_and_name_real_ports(objects) -> None:
    deployments = list(by_kind(objects, "Deployment").values())
    services = by_kind(objects, "Service")
    assert len(services) == 3
    for name, service in services.items():
        selector = service["spec"]["selector"]
        (target,) = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        for port in service["spec"]["ports"]:
            container_port(target, port["targetPort"])
        if container(target)["command"][2] != "gateway":
            # Headless: DNS returns every pod, so each gateway stream can stick to one of them.
            assert service["spec"]["clusterIP"] == "None", name


def test_gateway_dials_the_worker_services_by_dns(objects) -> None:
    config = config_of(deployment_for(objects, "gateway"))
    services = by_kind(objects, "Service")

    def service_address(module: str) -> str:
        deployment = deployment_for(objects, module)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (name,) = [n for n, s in services.items() if s["spec"]["selector"].items() <= labels.items()]
        (port,) = services[name]["spec"]["ports"]
        return f"dns:///{name}:{port['port']}"

    # The gateway resolves each name into a stream per pod (again as pods come and go).
    assert config.model_workers == [service_address("model_worker")]
    assert config.detok_workers == [service_address("detok_worker")]


def test_every_pod_mounts_the_model_cache_where_the_model_worker_writes_it(objects) -> None:
    cache_dir = config_of(deployment_for(objects, "model_worker")).cache_dir
    (claim,) = by_kind(objects, "PersistentVolumeClaim")
    assert "ReadWriteMany" in by_kind(objects, "PersistentVolumeClaim")[claim]["spec"]["accessModes"]
    for deployment in by_kind(objects, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in container(deployment)["volumeMounts"]}
        assert cache_dir in mounts, deployment["metadata"]["name"]
        assert volumes[mounts[cache_dir]["name"]]["persistentVolumeClaim"]["claimName"] == claim


def test_gateway_api_keys_come_from_a_secret_into_its_config_env(objects) -> None:
    (env,) = container(deployment_for(objects, "gateway"))["env"]
    field_name = re.fullmatch(r"TOKENWIRE_GATEWAY_(\w+)", env["name"]).group(1).lower()
    assert field_name == "api_key" and field_name in gateway.config.Config.__dataclass_fields__
    assert env["valueFrom"]["secretKeyRef"]["optional"] is True
