"""How one step runs on the Ray actors of every data-parallel rank.

    execute_all([(meta, draft_input) per rank]) -> [(DraftExtendInput, DraftInput) per rank]

Per rank: draft.propose -> target.forward_step -> draft.extend, or one call of the target
actor that hosts its drafter (draft placement "colocated": `draft` is None). The compiled executor
builds this once as a Ray compiled graph (ray.dag + experimental_compile) and runs every
node of every rank each step; ranks without work pass idle inputs from spec/. Its step inputs
travel as deltas over what each rank's first actor already holds (actors.step_stream), and with
`channel="shm"` every edge that has one reader on the writer's node carries its values over our own
channel (actors.shm_channel), the others over Ray's.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayTaskError

from actors.draft_runner import NoDrafter
from actors.shm_channel import ShmChannelType
from actors.step_stream import StreamSender
from spec.batch import placeholder_draft_input


@dataclass
class RankActors:
    target: "ray.actor.ActorHandle"
    draft: "ray.actor.ActorHandle | None"  # None: the target actor hosts the drafter


class CompiledStepExecutor:
    def __init__(self, ranks: list[RankActors], step_timeout_s: float, channel: str = "shm"):
        def hinted(node):
            if channel == "shm":
                node.type_hint = ShmChannelType()
            return node

        with InputNode() as inp:
            outputs = []
            for r, rank in enumerate(ranks):
                step = hinted(inp[r])
                if rank.draft is None:
                    outputs.append(hinted(rank.target.step.bind(step)))
                    continue
                meta_and_verify = hinted(rank.draft.propose.bind(step))
                ext = hinted(rank.target.forward_step.bind(meta_and_verify))
                outputs.append(hinted(rank.draft.extend.bind(meta_and_verify, ext)))
            dag = MultiOutputNode(outputs)
        # Ray's default 10 s limits would turn a long prefill on a busy CPU into a "failure".
        self.compiled = dag.experimental_compile(_submit_timeout=step_timeout_s)
        self.step_timeout_s = step_timeout_s
        # Per rank, what its first actor already holds of the step inputs (sent as deltas over it).
        self.senders = [StreamSender() for _ in ranks]

    def execute_all(self, steps: list) -> list:
        try:
            results, error = [], None
            refs = self.compiled.execute(*[s.encode(*step) for s, step in zip(self.senders, steps)])
            # Every rank's result is read, even after one raised, so the graph holds no stale output.
            for sender, ref in zip(self.senders, refs):
                try:
                    result = ref.get(timeout=self.step_timeout_s)
                except RayTaskError as exc:  # a runner raised: the graph itself is fine
                    error = error or exc
                    continue
                sender.returned(result[1])
                results.append(result)
            if error is not None:
                raise error
            return results
        except BaseException:
            # Which inputs the actors took is unknown: the next step's are sent whole, on new streams.
            for sender in self.senders:
                sender.reset()
            raise

    def teardown(self) -> None:
        self.compiled.teardown()


class ActorCallExecutor:
    """The same step as plain actor calls (object refs chained, nothing fetched in between)."""

    def __init__(self, ranks: list[RankActors]):
        self.ranks = ranks

    def execute_all(self, steps: list) -> list:
        refs = []
        for rank, step in zip(self.ranks, steps):
            if rank.draft is None:
                refs.append(rank.target.step.remote(step))
                continue
            meta_and_verify = rank.draft.propose.remote(step)
            ext = rank.target.forward_step.remote(meta_and_verify)
            refs.append(rank.draft.extend.remote(meta_and_verify, ext))
        return ray.get(refs)

    def teardown(self) -> None:
        pass


class TargetOnlyExecutor:
    """Decoding without speculation while draft actors restart: one-node trees verified by
    the target; the batch keeps placeholder DraftInput rows until a resync refills them."""

    def __init__(self, targets: list, hidden_spec, topk_width: int):
        self.targets = targets
        self.hidden_spec, self.topk_width = hidden_spec, topk_width
        self.no_draft = NoDrafter()

    def execute_all(self, steps: list) -> list:
        refs = [t.forward_step.remote((meta, self.no_draft.propose(meta, di))) for t, (meta, di) in zip(self.targets, steps)]
        out = []
        for (meta, _), ext in zip(steps, ray.get(refs)):
            verified = self.no_draft.extend(meta, ext).verified_id
            out.append((ext, placeholder_draft_input(verified, self.hidden_spec, self.topk_width)))
        return out

    def teardown(self) -> None:
        pass
