"""Autoscaling for real on one machine: a fake multi-node Ray cluster with an autoscaler,
the Serve config of deploy/serve_config.yaml deployed with a tiny model, HTTP load until
Serve adds an engine replica and the autoscaler adds a worker node for its placement
group, then load stops and the replicas go back down."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from netutil import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
API_KEY = "autoscaling-test-key"  # reaches the replicas as SPECGRAPH_API_KEY (the config's api_key_env)
HEAD_CPUS = 1  # one engine replica (0.1 + 0.5 target, no CPU for the drafter) and the ingress fit; a second needs a node

FAKE_CLUSTER = {
    "cluster_name": "fake-autoscaling",
    "max_workers": 2,
    "idle_timeout_minutes": 0.2,
    "upscaling_speed": 1.0,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "auth": {"ssh_user": "ubuntu"},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": HEAD_CPUS}, "node_config": {}, "max_workers": 0},
        "ray.worker.cpu": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    },
    "head_node_type": "ray.head.default",
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
    "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
    "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}


def _wait(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("autoscaling")
    config = root / "cluster.yaml"
    config.write_text(yaml.safe_dump(FAKE_CLUSTER))
    dash = free_port(8400, 8999)
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled",
               SPECGRAPH_API_KEY=API_KEY, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    log = open(root / "head.log", "w")
    head = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", "--port=6379", f"--autoscaling-config={config}",
         f"--num-cpus={HEAD_CPUS}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        _wait(lambda: subprocess.run([str(VENV_BIN / "ray"), "status", "--address", "127.0.0.1:6379"], env=env,
                                     capture_output=True).returncode == 0, 120, "the head node")
        ray.init(address="127.0.0.1:6379", log_to_driver=False)
        yield root, dash
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=120)
            log.close()


def _engine_replicas() -> int:
    status = serve.status().applications.get("default")
    if status is None or "SpecEngine" not in status.deployments:
        return 0
    return status.deployments["SpecEngine"].replica_states.get("RUNNING", 0)


def _alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def test_serve_and_cluster_scale_up_and_down(cluster, tiny_target):
    root, dash = cluster
    port = free_port(8100, 8399)
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"].update(model=str(tiny_target), speculative_algorithm="NGRAM", target_num_cpus=0.5, draft_num_cpus=0,
                       max_running_requests=4, kv_slots=2048, max_replicas=2,
                       torch_compile=False)  # replicas that start in seconds (compiling: test_compiled)
    engine = next(d for d in app["deployments"] if d["name"] == "SpecEngine")
    engine["autoscaling_config"].update(max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1,
                                        downscale_delay_s=5, metrics_interval_s=1, look_back_period_s=2)
    path = root / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy = subprocess.run([str(VENV_BIN / "serve"), "deploy", str(path), "--address", f"http://127.0.0.1:{dash}"],
                            capture_output=True, text=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    _wait(lambda: _engine_replicas() == 1, 300, "the first engine replica")
    assert _alive_nodes() == 1

    stop = asyncio.Event()
    received = [0]

    async def client(http: httpx.AsyncClient):
        """Streams one request after another until told to stop; any error status or error
        event ends the client with an exception, which the test reports."""
        body = {"model": str(tiny_target), "prompt": "w1 w2 w3", "max_tokens": 200, "temperature": 0,
                "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        while not stop.is_set():
            async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                                   headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    assert '"error"' not in line, line
                    received[0] += 1
                    if stop.is_set():
                        break

    async def load_until_scaled():
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(client(http)) for _ in range(12)]
            loop = asyncio.get_running_loop()
            try:
                deadline = time.time() + 300
                while time.time() < deadline:
                    replicas, nodes = await loop.run_in_executor(None, lambda: (_engine_replicas(), _alive_nodes()))
                    if replicas == 2 and nodes >= 2:
                        return replicas, nodes
                    await asyncio.sleep(1)
                return _engine_replicas(), _alive_nodes()
            finally:
                stop.set()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                errors.extend(o for o in outcomes if isinstance(o, BaseException))

    errors: list[BaseException] = []
    replicas, nodes = asyncio.run(load_until_scaled())
    assert not errors, f"{len(errors)} load client(s) failed, first: {errors[0]!r}"
    assert received[0] > 0, "the load never got a streamed chunk back"
    engine_status = serve.status().applications["default"].deployments["SpecEngine"]
    assert replicas == 2, f"Serve did not add an engine replica under load: {engine_status}, {ray.cluster_resources()}"
    assert nodes >= 2, "the autoscaler did not add a worker node for the second replica"
    _wait(lambda: _engine_replicas() == 1, 180, "the engine to scale back to one replica")
    _wait(lambda: _alive_nodes() == 1, 180, "the idle worker node to be removed")

