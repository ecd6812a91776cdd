"""Run replicas side by side: one pooled thread per replica, a single replica inline.

Each thread gets the caller's grad, inference, autocast and keyed-stream state and CUDA streams,
and on CPU its share of the intra-op threads. A replica's error aborts the group and is
re-raised, after every replica stopped, with ``replica N on DEVICE`` in front.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, Sequence

import torch

from tandem.errors import UsageError
from tandem.keyed import stream as keyed_stream

from .context import ReplicaAborted, ReplicaContext, ReplicaGroup, use
from .devices import device_scope
from .scatter_gather import first_tensor


class _Worker:
    """A daemon thread that runs one job at a time from its own queue."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="tandem-replica", daemon=True).start()

    def _loop(self):
        while True:
            job = self.jobs.get()
            job(self)
            del job  # do not keep the last batch's tensors alive while idle


# With ATen's OpenMP backend (torch's Linux builds) the intra-op thread count is per thread;
# with the native backend it sizes one pool for the whole process, so it is left alone there.
_PER_THREAD_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()

_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _after_fork_in_child() -> None:  # the pool's threads are gone; the lock may be held
    global _idle_lock
    _idle.clear()
    _idle_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _infer_device(module, args, kwargs) -> torch.device:
    t = first_tensor((args, kwargs))
    if t is None:
        t = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
    return t.device if t is not None else torch.device("cpu")


class _State:
    """Per-thread settings captured in the caller and re-entered in each replica thread."""

    def __init__(self, devices: Sequence[torch.device]):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        types = {d.type for d in devices} | {"cpu"}
        self.autocast = [(t, torch.get_autocast_dtype(t)) for t in sorted(types)
                         if torch.amp.is_autocast_available(t) and torch.is_autocast_enabled(t)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.place = keyed_stream.current()  # where keyed dropout stands (tandem.keyed)
        self.streams = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}
        self.total_threads = torch.get_num_threads()
        cpu_replicas = sum(d.type == "cpu" for d in devices)
        self.cpu_threads = max(1, self.total_threads // max(1, cpu_replicas))

    @contextlib.contextmanager
    def enter(self, device: torch.device):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if self.inference
                                else torch.set_grad_enabled(self.grad))
            stack.enter_context(keyed_stream.use(self.place))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.autocast_cache))
            if device.type == "cuda":
                # every device's caller stream, so a copy from another replica's tensor orders
                # after the source's work; its own device first: a stream context restores on
                # exit the device current at entry (a fresh thread: cuda:0)
                stack.enter_context(torch.cuda.device(device))
                for other, stream in self.streams.items():
                    if other != device:
                        stack.enter_context(torch.cuda.stream(stream))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            else:
                stack.enter_context(device_scope(device))
            if (_PER_THREAD_THREADS and device.type == "cpu"
                    and torch.get_num_threads() != self.cpu_threads):
                torch.set_num_threads(self.cpu_threads)
                # it also sets the default of threads started later: put the caller's back
                stack.callback(torch.set_num_threads, self.total_threads)
            yield


def _call(module, args, kwargs):
    if not isinstance(args, (list, tuple)):
        args = (args,)
    return module(*args, **kwargs)


def _raise_named(exc: BaseException, index: int, device: torch.device):
    """Raise ``exc`` with ``replica N on DEVICE`` in its message, its type kept."""
    where = f"replica {index} on {device}"
    try:
        renamed = type(exc)(f"{where}: {exc}")
    except Exception:
        renamed = None
    if renamed is not None and type(renamed) is type(exc):
        raise renamed from exc
    # the type needs other constructor arguments: keep the object, name the replica in it
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{where}: {exc.args[0]}",) + tuple(exc.args[1:])
    exc.add_note(f"raised in {where}")
    raise exc


def parallel_apply(modules: Sequence, inputs: Sequence, kwargs_list: Sequence | None = None,
                   devices: Sequence | None = None, group: ReplicaGroup | None = None) -> list:
    """The outputs of ``modules[i]`` on ``inputs[i]`` (a tuple of arguments, or one) with
    ``kwargs_list[i]`` on ``devices[i]`` (default: inferred), each in its own thread, meeting in
    ``group`` (default: a new :class:`ReplicaGroup`)."""
    n = len(modules)
    if len(inputs) != n:
        raise UsageError(f"parallel_apply got {n} modules but {len(inputs)} inputs")
    kwargs_list = [{}] * n if kwargs_list is None else list(kwargs_list)
    if len(kwargs_list) != n:
        raise UsageError(f"parallel_apply got {n} modules but {len(kwargs_list)} kwargs")
    if devices is None:
        devices = [_infer_device(m, a, k) for m, a, k in zip(modules, inputs, kwargs_list)]
    devices = [d if isinstance(d, torch.device) else torch.device(d) for d in devices]
    if len(devices) != n:
        raise UsageError(f"parallel_apply got {n} modules but {len(devices)} devices")
    if n == 0:
        return []
    group = ReplicaGroup(devices) if group is None else group
    if group.num_replicas != n:
        raise UsageError(f"parallel_apply got {n} modules but a group of {group.num_replicas}")
    if n == 1:  # inline: the caller's thread settings already apply, but for the device
        try:
            with device_scope(devices[0]), use(ReplicaContext(0, devices[0], group)):
                return [_call(modules[0], inputs[0], kwargs_list[0])]
        except Exception as exc:
            _raise_named(exc, 0, devices[0])
    return _in_threads(modules, inputs, kwargs_list, devices, group)


def _in_threads(modules, inputs, kwargs_list, devices: list[torch.device],
                group: ReplicaGroup) -> list:
    """Each replica on a pooled worker; the outputs, or the first real failure (not an abort)."""
    n = len(modules)
    state = _State(devices)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    done: queue.SimpleQueue = queue.SimpleQueue()

    def job(i):
        # the worker keeps ``run`` a moment after ``done``: it must not hold the replica then
        work = [modules[i], inputs[i], kwargs_list[i]]

        def run(worker):
            try:
                with state.enter(devices[i]), use(ReplicaContext(i, devices[i], group)):
                    results[i] = _call(*work)
            except BaseException as exc:  # every failure must reach the caller
                errors[i] = exc
                group.abort(exc)  # wake replicas waiting for this one at a rendezvous
            finally:
                work.clear()
                with _idle_lock:
                    _idle.append(worker)
                done.put(i)
        return run

    with _idle_lock:
        workers = [_idle.pop() for _ in range(min(n, len(_idle)))]
    workers += [_Worker() for _ in range(n - len(workers))]
    for i, worker in enumerate(workers):
        worker.jobs.put(job(i))
    for _ in range(n):
        done.get()

    failed = [i for i in range(n) if errors[i] is not None]
    if failed:
        real = [i for i in failed if not isinstance(errors[i], ReplicaAborted)]
        i = (real or failed)[0]
        _raise_named(errors[i], i, devices[i])
    return results
