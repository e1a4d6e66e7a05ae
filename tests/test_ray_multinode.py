"""Target and draft on different Ray nodes (a two-node `ray.cluster_utils.Cluster` with
custom resources): hidden states cross nodes and outputs equal the single-process run."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from graphs import EngineConfig, SamplingParams, build_graph

pytestmark = pytest.mark.integration

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node_a": 4}})
    cluster.add_node(num_cpus=4, resources={"node_b": 4})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_target_and_draft_on_different_nodes(two_nodes, tiny_target, tiny_eagle3_own):
    reference = build_graph(EngineConfig(model=str(tiny_target))).generate(PROMPTS, GREEDY)
    engine = build_graph(EngineConfig(
        model=str(tiny_target), speculative_algorithm="EAGLE3", draft_model=str(tiny_eagle3_own),
        eagle_topk=2, num_draft_tokens=5, backend="ray", kv_slots=1024, placement_strategy="SPREAD",
        target_resources={"node_a": 1}, draft_resources={"node_b": 1},
    ))
    try:
        target, draft = engine.actors()
        assert ray.get(target.node_id.remote()) != ray.get(draft.node_id.remote())
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    finally:
        engine.shutdown()
