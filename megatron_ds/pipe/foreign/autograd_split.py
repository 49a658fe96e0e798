"""The B/W split of any layer's backward through autograd, for layers that are not ours.

Our linears split themselves: inside a B op they queue their weight GEMMs (model/linear.WeightGradStore).
Any other layer's weight gradient is split off as torch.distributed.pipelining's stage_backward_input and
stage_backward_weight do it. B runs autograd towards the stage's inputs only, and records the gradient
reaching each node where a parameter's branch of the graph joins the inputs' part (the parameter's
frontier). W runs autograd again from those nodes, with those gradients, to the parameters: each node runs
the kernels of the fused backward on the same gradients, so the results are the fused ones, up to the
order in which a parameter used twice has its two contributions summed.

A custom autograd.Function's node must not run twice: it computes all its gradients in one call (ours
included: in B it queues its weight GEMM and returns the rest). A parameter whose W would pass through one
gets its gradient in B, with that node's single run. A reentrant activation checkpoint runs a backward of
its own inside its node, which autograd allows only in a backward of every leaf: a graph holding one runs
its whole backward in B. The Functions that forced either are named (`Split.whole`) so the engine can say
so once.
"""
import collections
import functools

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megatron_ds.model.linear import accumulate_grad


def _node(tensor):
    return get_gradient_edge(tensor).node


def _custom(node):
    """A custom autograd.Function's node: its backward is one call that we cannot take apart."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def _reentrant(node):
    """A reentrant activation checkpoint's node (torch's and DeepSpeed's CheckpointFunction): its backward runs
    a backward of its own, which autograd allows only in a backward of every leaf (no `inputs`, no .grad())."""
    return getattr(getattr(node, "_forward_cls", None), "__name__", None) == "CheckpointFunction"


def _foreign_name(node):
    """The Function's name where it is not ours (model/: ours defer their weight GEMMs themselves), else None."""
    cls = getattr(node, "_forward_cls", type(node))
    return None if cls.__module__.startswith("megatron_ds.") else cls.__qualname__


class _Graph:
    """The backward graph below `roots`, with its reverse edges."""

    def __init__(self, roots):
        self.parents = collections.defaultdict(list)
        self.nodes = set(roots)
        queue = collections.deque(self.nodes)
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                self.parents[child].append(node)
                if child not in self.nodes:
                    self.nodes.add(child)
                    queue.append(child)

    def above(self, starts):
        """`starts` (those in the graph) and every node whose backward reaches one of them."""
        seen = {n for n in starts if n in self.nodes}
        queue = collections.deque(seen)
        while queue:
            for parent in self.parents[queue.popleft()]:
                if parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        return seen

    def below(self, starts, within):
        """Nodes of `within` that the backward of `starts` reaches through nodes of `within`."""
        seen = {n for n in starts if n in within}
        queue = collections.deque(seen)
        while queue:
            for child, _ in queue.popleft().next_functions:
                if child in within and child not in seen:
                    seen.add(child)
                    queue.append(child)
        return seen

    def frontier(self, node, run_in_b):
        """The nodes of `run_in_b` first met on the way up from `node`, and the nodes passed before them."""
        found, passed, queue = set(), {node}, collections.deque([node])
        while queue:
            for parent in self.parents[queue.popleft()]:
                if parent in run_in_b:
                    found.add(parent)
                elif parent not in passed:
                    passed.add(parent)
                    queue.append(parent)
        return found, passed


class _Group:
    """Parameters whose W starts from the same nodes: the frontier nodes they share, and the outputs B did not
    need that lead to them. Groups share an autograd call only where neither reaches the other's parameters
    (`_batches`): a call that aimed at every parameter at once would also run the nodes between two groups'
    frontiers."""

    def __init__(self, params, frontier, roots):
        self.params, self.frontier, self.roots = params, frontier, roots

    def absorb(self, other):
        self.params |= other.params
        self.frontier |= other.frontier
        self.roots |= other.roots


def _groups(frontiers, root_nodes):
    owner, groups = {}, []
    for param, (found, passed) in frontiers.items():
        group = _Group({param}, set(found), passed & root_nodes)
        for other in {owner[k] for k in group.frontier | group.roots if k in owner}:
            group.absorb(other)
            groups.remove(other)
        groups.append(group)
        for key in group.frontier | group.roots:
            owner[key] = group
    return groups


class Split:
    """One B op's plan: which parameters get their gradients in B and which in W, from which nodes.

    `roots`/`grads`: the stage's outputs that need a gradient and those gradients (None: a scalar loss);
    `inputs`: the received activations that need one; `params`: the chunk's trainable parameters."""

    def __init__(self, roots, grads, inputs, params):
        self.roots = list(roots)
        self.grads = [torch.ones_like(r) if g is None else g for r, g in zip(self.roots, grads)]
        root_nodes = [_node(r) for r in self.roots]
        graph = _Graph(root_nodes)
        self.inputs = [x for x in inputs if _node(x) in graph.nodes]
        nodes = {_node(p): p for p in params if p.requires_grad}
        in_graph = {n: p for n, p in nodes.items() if n in graph.nodes}
        self.unseen = [p for n, p in nodes.items() if n not in graph.nodes]  # unused, or behind an opaque node
        self.whole = {_foreign_name(n) for n in graph.nodes if _reentrant(n)}
        self.reentrant = bool(self.whole)  # it refuses a backward limited to some tensors: all of it runs in B
        in_b, self.groups = set(in_graph) if self.reentrant else set(), []
        while not self.reentrant:  # each parameter moved to B widens what B runs: settle
            run_in_b = graph.above([_node(x) for x in self.inputs] + list(in_b))
            frontiers = {n: graph.frontier(n, run_in_b) for n in in_graph if n not in in_b}
            self.groups = _groups(frontiers, set(root_nodes))
            moved = self._must_run_in_b(graph, run_in_b)
            if not moved:
                break
            in_b |= moved
        self.b_params = [in_graph[n] for n in in_b]
        self.w_params = [in_graph[n] for g in self.groups for n in g.params]
        self._params = in_graph
        self.batches = _batches(self.groups, graph) if self.groups else []  # the groups of each autograd call of W

    def _must_run_in_b(self, graph, run_in_b):
        """The parameters whose W would run a custom Function's node a second time: one on their frontier, or
        one B ran that W would pass on its way from the frontier to them."""
        moved = set()
        if not any(_custom(n) for n in run_in_b):  # no node W could run twice: skip a walk of the graph a group
            return moved
        for group in self.groups:
            passing = graph.below(group.frontier, graph.above(group.params) & run_in_b)
            custom = [n for n in passing if _custom(n)]
            if custom:
                moved |= group.params
                self.whole.update(filter(None, map(_foreign_name, custom)))
        return moved

    def hidden(self):
        """A marker of the gradients of the parameters the graph does not show (unused, or behind an
        opaque node such as a reentrant activation checkpoint); `hidden_changed` compares after B."""
        return [(p, p.grad, None if p.grad is None else p.grad._version) for p in self.unseen]

    @staticmethod
    def hidden_changed(marker):
        """How many of `marker`'s parameters got a gradient since: their backward ran whole, in B."""
        return sum(1 for p, grad, version in marker
                   if p.grad is not grad or (grad is not None and grad._version != version))

    def backward_input(self):
        """B: the inputs' gradients (into their .grad) and the B parameters'; returns W's pass, or None."""
        captured, handles = {}, []
        for node in set().union(*(g.frontier for g in self.groups)):
            handles.append(node.register_prehook(functools.partial(_capture, captured, node)))
        targets = self.inputs + self.b_params
        try:
            if self.reentrant:
                torch.autograd.backward(self.roots, self.grads)
            elif targets:
                torch.autograd.backward(self.roots, self.grads, inputs=targets, retain_graph=bool(self.groups))
        finally:
            for handle in handles:
                handle.remove()
        if not self.groups:
            return None
        edges = {node: (get_gradient_edge(r), g) for node, r, g in zip(map(_node, self.roots), self.roots, self.grads)}
        calls = []
        for batch in self.batches:
            calls.append(([(node, captured.get(node)) for g in batch for node in g.frontier],
                          [edges[n] for g in batch for n in g.roots],
                          [self._params[n] for g in batch for n in g.params]))
        return functools.partial(_backward_weight, calls)


def _below_masks(graph, bits):
    """{node: the bits (of `bits`: {node: int}) of the nodes its backward reaches, its own included}: one walk of the
    graph in post-order."""
    masks, stack = {}, [(n, False) for n in graph.nodes]
    while stack:
        node, children_done = stack.pop()
        if node in masks:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            mask = bits.get(node, 0)
            for child in children:
                mask |= masks[child]
            masks[node] = mask
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in masks)
    return masks


def _batches(groups, graph):
    """The groups in as few autograd calls as the math allows: two groups share a call only where neither one's
    starting nodes (frontier, outputs) reach the other's parameters. Such a call runs what their separate calls run,
    each node on the same gradients (no node is on both's way), so the gradients are the same to the bit; one
    reaching the other would run the nodes between them (the inputs' backward) a second time."""
    bits = {}
    for i, group in enumerate(groups):
        for node in group.params:
            bits[node] = bits.get(node, 0) | 1 << i
    masks = _below_masks(graph, bits)
    batches = []  # [groups, their bits, the bits their starts reach]
    for i, group in enumerate(groups):
        reach = 0
        for node in group.frontier | group.roots:
            reach |= masks[node]
        reach &= ~(1 << i)
        for batch in batches:
            if not (reach & batch[1] or batch[2] & 1 << i):
                batch[0].append(group)
                batch[1] |= 1 << i
                batch[2] |= reach
                break
        else:
            batches.append([[group], 1 << i, reach])
    return [b[0] for b in batches]


def _capture(captured, node, grad_outputs):
    captured[node] = grad_outputs


def _replay(saved, grad_outputs):
    """A frontier node reached again in W from another frontier node takes B's gradient, not a second one."""
    return saved


def _backward_weight(calls):
    """W: each batch of groups' parameters' gradients from the gradients B left at their frontier (and at the
    outputs B did not need), accumulated as autograd accumulates them."""
    for i, (frontier, outside, params) in enumerate(calls):
        edges, grads, handles = [], [], []
        for node, saved in frontier:
            if saved is None:  # B passed no gradient through it: it owes none
                continue
            handles.append(node.register_prehook(functools.partial(_replay, saved)))
            for k, grad in enumerate(saved):
                if grad is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(grad)
        for edge, grad in outside:
            edges.append(edge)
            grads.append(grad)
        try:
            last = i == len(calls) - 1  # a node between two batches' frontiers may run in both
            dws = (torch.autograd.grad(edges, params, grads, retain_graph=not last, allow_unused=True) if edges
                   else [None] * len(params))
        finally:
            for handle in handles:
                handle.remove()
        for param, dw in zip(params, dws):
            if dw is not None:
                accumulate_grad(param, dw)
    calls.clear()
