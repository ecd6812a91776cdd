"""Replicas of a module, one per device, connected to autograd and reused across steps.

Replicas are shallow module copies holding differentiable views of the parameters, whose
gradients sum into the originals in replica order; the home replica is ``module`` itself, the
others get fresh buffer copies each call. Warning: they are cached on ``module`` (per devices
and thread): finish a forward before replicating again. ``zero_grad`` does nothing in a replica.
"""

from __future__ import annotations

import threading
import weakref
from typing import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tandem.errors import UsageError

from . import traffic
from .broadcast import copy_params
from .devices import resolve_devices
from .guards import ReplicaZeroGrad, first_lazy
from .scatter_gather import nbytes

_CACHE_ATTR = "_tandem_replica_cache"
_MAX_ENTRIES = 8  # replica sets kept per module (device tuples x calling threads)


class ReplicaCache:
    """Replica sets cached on a module; copies and pickles as an empty cache."""

    def __init__(self):
        self.entries: dict = {}
        self.lock = threading.Lock()

    def __deepcopy__(self, memo):
        return ReplicaCache()

    def __reduce__(self):
        return (ReplicaCache, ())


def _walk(root: nn.Module):
    """Modules in a fixed order (each once), their fingerprint and every tensor's device."""
    modules, seen, fingerprint, where = [], set(), [], set()
    add = fingerprint.append
    todo = [root]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        d = m.__dict__
        if "zero_grad" not in d:  # once per module (not over another's); copies take it along
            d["zero_grad"] = ReplicaZeroGrad(m)
        fingerprint += [id(m), len(d)]
        for child in d["_modules"].values():
            add(id(child))
            if child is not None:
                todo.append(child)
        fingerprint += map(id, d["_parameters"].values())
        for t in (*d["_parameters"].values(), *d["_buffers"].values()):
            if is_lazy(t):
                raise UsageError(f"replicate: {first_lazy(root)!r} of {type(root).__name__} is "
                                 f"uninitialised (a lazy module): run it once on a batch first",
                                 hint="DataParallel does this for you")
            device = None if t is None else t.device
            add(device)
            where.add(device)
    where.discard(None)
    return modules, fingerprint, where


class _ReplicaSet:
    """Shallow copies of every module of one tree, for every non-home device, the originals held
    weakly (no cycle through the cache). ``detached``: every replica is a copy whose parameters
    are detached leaves (``self.leaves``); the home copy holds the original buffers."""

    def __init__(self, modules: list[nn.Module], devices: list[torch.device], home: int | None,
                 share: bool, detached: bool = False):
        self.home, self.share, self.detached = home, share, detached
        self.leaves: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # weak: checked with the fingerprint (ids alone could be reused by new modules)
        self.originals = [weakref.ref(m) for m in modules]
        index = {id(m): j for j, m in enumerate(modules)}
        self.trees: dict[int, list[nn.Module]] = {}
        for i, device in enumerate(devices):
            if i == home and not detached:
                continue
            copies = []
            for m in modules:
                rep = m.__class__.__new__(m.__class__)
                rep.__dict__ = m.__dict__.copy()
                rep.__dict__.pop(_CACHE_ATTR, None)  # the cache must not reach its own replicas
                copies.append(rep)
            for m, rep in zip(modules, copies):
                rep.__dict__["_modules"] = {name: None if c is None else copies[index[id(c)]]
                                            for name, c in m.__dict__["_modules"].items()}
            self.trees[i] = copies
        # per module: names of its parameters; every replica gets each through copy_params
        self.moved = [[name for name, p in m.__dict__["_parameters"].items() if p is not None]
                      for m in modules]

    def alive(self, modules: list[nn.Module]) -> bool:
        return all(ref() is m for ref, m in zip(self.originals, modules))

    def refresh(self, modules: list[nn.Module], devices: list[torch.device]) -> None:
        # the last step's copies go first: held through the copy, they would add to the peak
        self.leaves = {}
        for reps in self.trees.values():
            for m, rep in zip(modules, reps):
                rep.__dict__["_parameters"] = dict(m.__dict__["_parameters"])
                if "_flat_weights" in rep.__dict__:  # an RNN's list of the same copies
                    rep.__dict__["_flat_weights"] = list(m.__dict__["_flat_weights"])
        moving = {}  # each parameter once, tied ones too
        for m, names in zip(modules, self.moved):
            params = m.__dict__["_parameters"]
            moving.update((id(params[name]), params[name]) for name in names)
        if self.detached:
            copies = self._leaves(list(moving.values()), devices)
        else:
            copies, by_source = {}, {}
            for p in moving.values():
                by_source.setdefault(p.device, []).append(p)
            targets = [(i, devices[i]) for i in self.trees]
            for params in by_source.values() if targets else ():
                copies.update(copy_params(params, targets, self.share))
        for i, reps in self.trees.items():
            device = devices[i]
            buffer_copies: dict = {}
            for m, rep, names in zip(modules, reps, self.moved):
                md, rd = m.__dict__, rep.__dict__
                own_modules, own_params = rd["_modules"], rd["_parameters"]
                rd.update(md)  # training flag, hooks, plain attributes
                rd.pop(_CACHE_ATTR, None)
                rd["_modules"] = own_modules
                for name in names:
                    p = md["_parameters"][name]
                    own_params[name] = copies.get((id(p), i), p)
                rd["_parameters"] = own_params
                if names and isinstance(m, nn.RNNBase):
                    # RNNs compute from a list of their weights kept beside _parameters (torch's
                    # replicate refreshes it too): point it at this replica's copies
                    rd["_flat_weights"] = [own_params.get(n) for n in md["_flat_weights_names"]]
                if i == self.home:  # detached home copy: the module's own buffer dict
                    continue
                for b in md["_buffers"].values():
                    if b is not None and id(b) not in buffer_copies:  # tied buffers stay tied
                        buffer_copies[id(b)] = b.clone() if b.device == device else b.to(device)
                rd["_buffers"] = {name: None if b is None else buffer_copies[id(b)]
                                  for name, b in md["_buffers"].items()}

    def _leaves(self, params: list[torch.Tensor], devices: list[torch.device]) -> dict:
        """A detached leaf per (parameter, replica), each with its own ``.grad``, over ONE
        storage per device (the parameter's own, or one copy)."""
        copies, moved = {}, {}  # moved: (id(param), device) -> the one copy there
        for i in self.trees:  # refresh emptied self.leaves
            pairs, device = [], devices[i]
            for p in params:
                if p.device != device and (id(p), device) not in moved:
                    moved[id(p), device] = p.detach().to(device)
                leaf = (p if p.device == device else moved[id(p), device]).detach()
                leaf.requires_grad_(p.requires_grad)
                copies[id(p), i] = leaf
                pairs.append((p, leaf))
            self.leaves[i] = pairs
        return copies

    def roots(self, module: nn.Module, count: int) -> list[nn.Module]:
        return [module if i == self.home and not self.detached else self.trees[i][0]
                for i in range(count)]


def _record_traffic(module: nn.Module, devices: list[torch.device], home: int | None) -> None:
    params = sum(map(nbytes, module.parameters()))
    grads = sum(nbytes(p) for p in module.parameters() if p.requires_grad)
    buffers = sum(map(nbytes, module.buffers()))
    for i in range(len(devices)):
        if i != home:
            traffic.record("broadcast", params + buffers, i)
            if torch.is_grad_enabled() and grads:
                # counted here: shared-storage replicas have no transfer to observe, yet their
                # gradients sum into the originals (a reduce on real devices)
                traffic.record("reduce", grads, home)


def replicate(module: nn.Module, devices: Sequence, share_params: bool = True) -> list[nn.Module]:
    """One replica of ``module`` per entry of ``devices``, the first on ``module``'s own device
    being ``module`` itself. ``share_params=False``: every other replica gets its own parameter
    copy even there (distinct GPUs' copy-and-reduce path, on CPU)."""
    return _replica_set(module, devices, share_params, False)[0]


def replicate_detached(module: nn.Module, devices: Sequence):
    """``(replicas, leaves)``: replicas whose parameters are detached leaves (every one a copy),
    ``leaves[i]`` replica ``i``'s ``(parameter, leaf)`` pairs; gradients reach the parameters
    only through :mod:`tandem.parallel.threaded_backward`."""
    replicas, replica_set = _replica_set(module, devices, True, True)
    return replicas, [replica_set.leaves[i] for i in range(len(replicas))]


def _replica_set(module: nn.Module, devices: Sequence, share_params: bool, detached: bool):
    """``(replicas, their _ReplicaSet)``; ``None`` when the one replica is ``module`` itself."""
    devices = resolve_devices(devices)
    cache = module.__dict__.get(_CACHE_ATTR)
    if not isinstance(cache, ReplicaCache):  # before the walk: it counts the root's attributes
        cache = module.__dict__[_CACHE_ATTR] = ReplicaCache()
    modules, fingerprint, where = _walk(module)
    place = next(iter(where), None) if len(where) <= 1 else False  # False: spread, no home
    home = next((i for i, d in enumerate(devices) if place is None or d == place), None)
    if len(devices) == 1 and home == 0 and not detached:  # nothing moves: no traffic either
        return [module], None
    key = (tuple(devices), bool(share_params), detached, threading.get_ident())
    entry = cache.entries.get(key)
    if entry is None or entry[0] != fingerprint or not entry[1].alive(modules):
        entry = (fingerprint, _ReplicaSet(modules, devices, home, bool(share_params), detached))
        with cache.lock:
            if len(cache.entries) >= _MAX_ENTRIES:
                cache.entries.pop(next(iter(cache.entries)))
            cache.entries[key] = entry
    replica_set = entry[1]
    replica_set.refresh(modules, devices)
    if traffic.metering():
        _record_traffic(module, devices, home)
    return replica_set.roots(module, len(devices)), replica_set
