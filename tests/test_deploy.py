"""The deployment configs validate with Ray's own schemas and agree with each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from serve.settings import RAY_GCS_ENV, split_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _serve_config() -> dict:
    return yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())


def test_serve_config_validates_and_autoscales():
    schema = ServeDeploySchema.model_validate(_serve_config())
    app = schema.applications[0]
    assert app.import_path == "serve_app:build_app"
    engine = next(d for d in app.deployments if d.name == "SpecEngine")
    scaling = engine.autoscaling_config
    assert scaling["min_replicas"] == 1 < scaling["max_replicas"]
    for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
        assert key in scaling
    # The application args are accepted by the app builder (engine config validated too).
    engine_kwargs, settings = split_args(app.args)
    assert engine_kwargs["model"] == "smollm2-135m-instruct"
    assert settings.max_replicas == scaling["max_replicas"]


def test_cluster_config_validates():
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # fills defaults the way `ray up` does, then checks the schema
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    assert {"cpu_worker", "gpu_worker"} <= set(workers)
    assert all(v["min_workers"] < v["max_workers"] for v in workers.values())
    assert workers["gpu_worker"]["resources"]["GPU"] >= 1
    assert any("make setup" in c for c in config["setup_commands"])
    assert any("serve deploy deploy/serve_config.yaml" in c for c in config["head_start_ray_commands"])


def test_kuberay_service_uses_the_same_serve_config():
    service = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    serve_v2 = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_v2)
    assert serve_v2["applications"] == _serve_config()["applications"]
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert all(g["minReplicas"] < g["maxReplicas"] for g in groups)


def _settings(args: dict):
    return split_args(args)[1]


def test_deploy_configs_refuse_to_serve_the_world_without_a_key(monkeypatch):
    """Both deploy configs bind every address and name the key's environment variable (never
    the key itself): without the variable the app refuses to start, naming the field."""
    service = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    for config in (_serve_config(), yaml.safe_load(service["spec"]["serveConfigV2"])):
        host, args = config["http_options"]["host"], config["applications"][0]["args"]
        assert "api_key" not in args and args["api_key_env"] == "SPECGRAPH_API_KEY"
        settings = _settings(args)
        monkeypatch.delenv("SPECGRAPH_API_KEY", raising=False)
        with pytest.raises(ValueError, match="api_key"):
            settings.check_exposure(host)
        settings.check_exposure("127.0.0.1")  # loopback: a local trial needs no key
        monkeypatch.setenv("SPECGRAPH_API_KEY", "k" * 32)
        settings.check_exposure(host)
        assert settings.resolved_api_key() == "k" * 32
    # The key reaches every Ray container from a Kubernetes secret.
    cluster = service["spec"]["rayClusterConfig"]
    for spec in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
        assert "secretKeyRef" in env["SPECGRAPH_API_KEY"]["valueFrom"]


def test_ray_dashboard_is_not_on_every_address():
    head_params = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())[
        "spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head_params["dashboard-host"] == "$(POD_IP)"
    commands = " ".join(yaml.safe_load((DEPLOY / "cluster.yaml").read_text())["head_start_ray_commands"])
    assert "--dashboard-host=" in commands and "0.0.0.0" not in commands


def test_cluster_configs_bound_the_gcs_task_events():
    """The GCS keeps up to 100,000 tasks' events (and 1,000,000 dropped ids) by default and grew
    through a soak: every head starts Ray with the bounds the local server uses."""
    head = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())[
        "spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    start = next(c for c in yaml.safe_load((DEPLOY / "cluster.yaml").read_text())["head_start_ray_commands"]
                 if "ray start --head" in c)
    for name, value in RAY_GCS_ENV.items():
        assert env[name] == value
        assert f"{name}={value} " in start.split("ray start")[0]
