"""Each CPU replica's backward in its own thread.

Autograd runs one backward's CPU work in the calling thread (GPUs have a thread each). Here
replicas compute on detached leaves (:func:`~tandem.parallel.replicate.replicate_detached`) and
their outputs meet the graph at ONE node, :class:`_Join`, whose backward runs each replica's
backward in its thread and sums the gradients in replica order (the same bits whoever finishes
first); ``SyncBatchNorm`` meets there too. Warning: no double backward.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .broadcast import ordered_sum
from .context import ReplicaGroup
from .parallel_apply import parallel_apply
from .replicate import replicate_detached
from .scatter_gather import map_tensors, tensors_in


def decide(devices: Sequence[torch.device], wanted: bool | None = None, split: bool = False,
           threads: int | None = None) -> bool:
    """Whether replicas on ``devices`` run their backward in threads: ``wanted`` if given, else
    with two CPU replicas or more when ``split`` is set or the threads add cores (fewer intra-op
    ``threads``, default now's, than CPU replicas). Decided once: the bits depend on it."""
    if wanted is not None:
        return bool(wanted)
    cpu = sum(torch.device(d).type == "cpu" for d in devices)
    if cpu < 2:
        return False
    total = torch.get_num_threads() if threads is None else threads
    return split or cpu * max(1, total // cpu) > total


def applies(devices: Sequence[torch.device], inputs, kwargs, threaded: bool) -> bool:
    """Whether this forward takes the path :func:`decide` chose (``threaded``): grad on, two CPU
    replicas or more, and no input needing a gradient."""
    if not threaded or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    cpu = sum(d.type == "cpu" for d in devices)
    return cpu >= 2 and not any(t.requires_grad for t in tensors_in((inputs, kwargs)))


class Replicas(list):
    """Replicas on detached leaves; ``leaves[i]``: replica ``i``'s ``(parameter, leaf)`` pairs."""

    def __init__(self, module, devices: Sequence[torch.device]):
        replicas, self.leaves = replicate_detached(module, devices)
        super().__init__(replicas)


def apply(modules: Sequence, leaves: list, inputs, kwargs, devices: Sequence[torch.device]
          ) -> list:
    """``parallel_apply`` of ``modules`` (a :class:`Replicas`' or callables around them) in a
    separate-backward group, the outputs :func:`join`-ed."""
    group = ReplicaGroup(devices, separate_backward=True)
    outputs = parallel_apply(modules, inputs, kwargs, devices, group=group)
    return join(outputs, leaves, group)


class _Backward:
    """What :class:`_Join`'s backward needs: each replica's outputs, leaves and device."""

    def __init__(self, params, leaves, outputs, group):
        self.params, self.leaves, self.outputs, self.group = params, leaves, outputs, group

    def run(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each replica's backward in its thread; the parameters' gradients, summed in order."""
        pending = iter(grads)  # replica-major, as join collected the outputs
        work = [functools.partial(_replica_backward, outs, [next(pending) for _ in outs], leaves)
                for outs, leaves in zip(self.outputs, self.leaves)]
        # in the forward's group: layers that met in forward meet again in backward there
        found = parallel_apply(work, [()] * len(work), devices=self.group.devices, group=self.group)
        self.outputs = None  # frees every replica's graph
        parts = [[g[j] for g in found if g is not None and g[j] is not None]
                 for j in range(len(self.params))]
        return [ordered_sum(column, p.device) if column else None
                for column, p in zip(parts, self.params)]


def _replica_backward(outputs, grads, leaves):
    """One replica's backward: the gradients of its leaves from its outputs' gradients."""
    if not any(leaf.requires_grad for _, leaf in leaves):
        return None
    # zeros for unused outputs: every replica must meet the others (SyncBatchNorm)
    grads = [torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads)]
    # backward() rather than grad(inputs=...), which reentrant checkpointing refuses
    torch.autograd.backward(outputs, grads)
    found = [leaf.grad for _, leaf in leaves]
    for _, leaf in leaves:
        leaf.grad = None
    return found


class _Join(torch.autograd.Function):
    """``apply(job, n_params, *params, *outputs)``: the (detached) ``outputs`` again, as views
    whose backward is ``job.run``; gradients go to ``params`` only."""

    @staticmethod
    def forward(ctx, job, n_params, *tensors):
        ctx.job, ctx.n_params = job, n_params
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in tensors[n_params:])

    @staticmethod
    def backward(ctx, *grads):
        job, ctx.job = ctx.job, None
        if torch.is_grad_enabled():
            raise RuntimeError("no double backward (create_graph=True) through threaded CPU "
                               "replicas: build the DataParallel with backward_threads=False")
        if job is None:
            raise RuntimeError("the replicas' graph was already used by a backward; a second "
                               "backward through a DataParallel forward is not supported")
        return (None, None, *job.run(grads), *([None] * len(grads)))


def join(outputs: list, leaves: list, group: ReplicaGroup) -> list:
    """The replicas' ``outputs`` with one autograd node between them and the parameters
    (``leaves``: from ``replicate_detached``; ``group``: their forward's)."""
    params = [p for p, _ in leaves[0]] if leaves else []
    trainable = [j for j, p in enumerate(params) if p.requires_grad]
    if not trainable:
        return outputs
    flat = [[t for t in tensors_in(out) if t.requires_grad] for out in outputs]
    if not any(flat):
        return outputs
    job = _Backward([params[j] for j in trainable],
                    [[pairs[j] for j in trainable] for pairs in leaves], flat, group)
    joined = _Join.apply(job, len(trainable), *job.params,
                         *(t.detach() for mine in flat for t in mine))
    return _swap(outputs, [t for mine in flat for t in mine], joined)


def _swap(outputs: list, originals: list, joined) -> list:
    """``outputs`` with ``originals[k]`` replaced by ``joined[k]``, checked to be visited in
    ``tensors_in``'s order (else gradients would swap silently)."""
    pairs = iter(zip(originals, joined))

    def swap(t):
        if not t.requires_grad:
            return t
        original, new = next(pairs, (None, None))
        if original is not t:
            raise RuntimeError("threaded backward: the outputs' tensors were visited in another "
                               "order than they were collected (tensors_in vs map_tensors)")
        return new

    swapped = [map_tensors(out, swap) for out in outputs]
    if next(pairs, None) is not None:
        raise RuntimeError("threaded backward: an output tensor collected by tensors_in was "
                           "not visited by map_tensors")
    return swapped
