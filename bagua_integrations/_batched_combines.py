"""One all-reduce for the independent whole-parameter reductions of a compiled step over shards.

Under FSDP2 a segmented step combines each reduction's per-segment partial values across ranks in
``_segmented.segment_combine``: one all-reduce per reduction and run. LAMB on BERT-base makes four a
step (two norms, for the run of matrices and the run of vectors), and each waits for every rank: on
2 gloo ranks they were 115 of the 170 ms of 30 steps of a small model. The four do not depend on one
another, so they can travel together. (An eager step cannot look ahead: it holds each reduction
until the step first uses one, ``_segmented._PendingCombines``, which makes one all-reduce per run.)

:class:`BatchCombines` is an Inductor post-grad pass: on the functional graph Inductor compiles, it
groups the ``segment_combine`` calls that share a process group and that no other of them feeds
(their *depth*: how many combines lie on the longest path to them), replaces each group with one
``segment_combine_many`` (one all-reduce per reduce operation and dtype), and re-orders the graph
topologically, each node as early as its original place allows. Every rank compiles the same graph,
so every rank makes the same collectives in the same order. The pass leaves a graph unchanged unless
every input mutation (``copy_`` into a graph input) comes after all other computation, as
functionalization places them: a re-ordered graph then still reads each input before writing it.
"""

from __future__ import annotations

import heapq
import operator
from typing import Dict, List

import torch

from ._early_stores import is_input_mutation
from ._segmented import _BY_KEY, all_reduce_together, segment_values

__all__ = ["segment_combine_many", "batch_combines"]


@torch.library.custom_op("bagua_integrations::segment_combine_many", mutates_args=())
def segment_combine_many(partials: List[torch.Tensor], keys: str, hows: str) -> List[torch.Tensor]:
    """``segment_combine(partials[i], keys[i], hows[i])`` for every ``i`` (``keys`` and ``hows``
    comma-separated: an operator takes no list of strings), all segmentations sharded over one
    process group: one all-reduce per reduce operation and dtype for all of them."""
    keys, hows = keys.split(","), hows.split(",")
    values = [segment_values(part, _BY_KEY[key], how) for part, key, how in zip(partials, keys, hows)]
    shards = _BY_KEY[keys[0]].shard_group
    if shards is None:
        return values
    # (outputs of a custom operator may not share memory)
    return [part.clone() for part in all_reduce_together(values, hows, shards)]


@segment_combine_many.register_fake
def _(partials, keys, hows):
    return [part.new_empty(_BY_KEY[key].segments) for part, key in zip(partials, keys.split(","))]


def batch_combines(graph: torch.fx.Graph) -> bool:
    """Batch ``graph``'s independent ``segment_combine`` calls over shards (see the module docstring);
    True when it changed the graph."""
    single = torch.ops.bagua_integrations.segment_combine.default
    nodes = list(graph.nodes)
    combines = [n for n in nodes if n.target is single]
    if len(combines) < 2:
        return False
    position = {n: i for i, n in enumerate(nodes)}
    mutations = [n for n in nodes if is_input_mutation(n)]
    computing = [n for n in nodes if n.op not in ("placeholder", "output") and not is_input_mutation(n)]
    if mutations and computing and min(position[n] for n in mutations) < max(position[n] for n in computing):
        return False  # an input is written before the last computation: re-ordering could read it late
    depth: Dict[torch.fx.Node, int] = {}
    for node in nodes:
        depth[node] = max((depth[a] for a in node.all_input_nodes), default=0) + (node.target is single)
    groups: Dict[tuple, List[torch.fx.Node]] = {}
    for node in combines:
        seg = _BY_KEY.get(node.args[1])
        if seg is not None and seg.shard_group is not None:
            groups.setdefault((depth[node], id(seg.shard_group)), []).append(node)
    batches = [members for members in groups.values() if len(members) > 1]
    if not batches:
        return False
    many = torch.ops.bagua_integrations.segment_combine_many.default
    for members in batches:
        with graph.inserting_before(members[0]):
            batched = graph.call_function(many, ([m.args[0] for m in members], ",".join(m.args[1] for m in members),
                                                 ",".join(m.args[2] for m in members)))
        position[batched] = position[members[0]]
        batched.meta["val"] = [member.meta.get("val") for member in members]
        for index, member in enumerate(members):
            with graph.inserting_before(member):
                value = graph.call_function(operator.getitem, (batched, index))
            value.meta.update(member.meta)
            position[value] = position[member]
            member.replace_all_uses_with(value)
            graph.erase_node(member)
    _stable_topological_order(graph, position)
    graph.lint()
    return True


def _stable_topological_order(graph: torch.fx.Graph, position: Dict[torch.fx.Node, int]) -> None:
    """Re-order ``graph``: each node as soon as its inputs are in place, earlier original places first
    (Kahn's algorithm with a heap); placeholders stay first, the output last."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}  # (ties: the graph's current order)
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(position[n], index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = heapq.heappop(ready)[2]
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (position[user], index[user], user))
    assert len(order) == len(nodes), "a cycle in the graph"
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    output = [n for n in order if n.op == "output"]
    cursor = placeholders[-1]  # (a graph with combines has inputs)
    for node in rest + output:
        cursor.append(node)
        cursor = node

