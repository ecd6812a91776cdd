import contextlib
import threading

import pytest
import torch
from torch import nn

from tandem.parallel import context, parallel_apply
from tandem.parallel.context import ReplicaAborted


class Probe(nn.Module):
    """Records what the replica thread sees, then returns ``x * 2``."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x, shift=0.0):
        ctx = context.current()
        self.log.append({
            "thread": threading.current_thread(), "index": ctx.index, "device": ctx.device,
            "group": ctx.group, "threads": torch.get_num_threads(),
            "grad": torch.is_grad_enabled(), "autocast": torch.is_autocast_enabled("cpu"),
        })
        return x * 2 + shift


@pytest.mark.parametrize("n", [2, 3, 4])
def test_replicas_run_in_parallel_threads(n):
    """Each replica blocks until all n reached the barrier: impossible if run one by one."""
    barrier = threading.Barrier(n, timeout=20)

    class Meet(nn.Module):
        def forward(self, x):
            barrier.wait()
            return threading.get_ident()

    idents = parallel_apply([Meet() for _ in range(n)], [torch.ones(1)] * n, devices=["cpu"] * n)
    assert len(set(idents)) == n and threading.get_ident() not in idents


def test_context_kwargs_and_order():
    log = []
    modules = [Probe(log) for _ in range(3)]
    outs = parallel_apply(modules, [torch.full((1,), float(i)) for i in range(3)],
                          [{"shift": 1.0}, {}, {"shift": 3.0}], ["cpu"] * 3)
    assert [o.item() for o in outs] == [1.0, 2.0, 7.0]
    assert sorted(e["index"] for e in log) == [0, 1, 2]
    assert len({id(e["group"]) for e in log}) == 1  # one group shared by the call's replicas
    assert log[0]["group"].num_replicas == 3
    assert context.current() is None  # nothing leaks into the caller


def test_single_replica_runs_inline_with_a_context():
    log = []
    out = parallel_apply([Probe(log)], [(torch.ones(2),)])
    assert log[0]["thread"] is threading.current_thread() and log[0]["index"] == 0
    assert out[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("n", [2, 3])
def test_cpu_threads_are_split_and_the_caller_keeps_its_own(n):
    before = torch.get_num_threads()
    log = []
    parallel_apply([Probe(log) for _ in range(n)], [torch.ones(1)] * n, devices=["cpu"] * n)
    assert all(e["threads"] == max(1, before // n) for e in log)
    assert torch.get_num_threads() == before
    fresh = []  # a thread started later takes up the process default, which must be unchanged
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [before]


def test_grad_mode_and_autocast_reach_the_threads():
    log = []
    with torch.no_grad():
        parallel_apply([Probe(log) for _ in range(2)], [torch.ones(1)] * 2)
    assert [e["grad"] for e in log] == [False, False]
    log.clear()
    linear = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply([linear, linear], [torch.randn(2, 4)] * 2)
        parallel_apply([Probe(log) for _ in range(2)], [torch.ones(1)] * 2)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    assert all(e["autocast"] for e in log)



class _FakeCudaStreams:
    """torch.cuda's current device and per-device current streams, kept per thread, as
    torch's stream context moves them: setting a stream makes its device current (a
    ``cudaSetDevice``, recorded in ``set_devices``), and leaving the context sets back the
    stream of the device that was current on entry. Streams are named "... cuda:i"."""

    def __init__(self):
        self.local = threading.local()
        self.set_devices: list[int] = []  # by set_stream, any thread

    def state(self) -> dict:
        if not hasattr(self.local, "streams"):
            self.local.streams, self.local.device = {}, 0
        return self.local.__dict__

    def current_stream(self, device=None):
        index = torch.device(device).index if device is not None else self.state()["device"]
        return self.state()["streams"].get(index, f"default of cuda:{index}")

    def _set_stream(self, stream):
        index = int(stream.rsplit(":", 1)[1])
        self.state()["streams"][index] = stream
        self.state()["device"] = index
        self.set_devices.append(index)

    @contextlib.contextmanager
    def stream(self, stream):
        state, index = self.state(), int(stream.rsplit(":", 1)[1])
        source = self.current_stream()  # of the device current on entry
        target = self.current_stream(f"cuda:{index}")
        self._set_stream(stream)
        try:
            yield
        finally:
            if int(source.rsplit(":", 1)[1]) != index:
                self._set_stream(target)
            self._set_stream(source)
            assert state is self.state()

    @contextlib.contextmanager
    def device(self, device):
        state = self.state()
        before, state["device"] = state["device"], torch.device(device).index
        try:
            yield
        finally:
            state["device"] = before


def test_every_replica_thread_sees_the_callers_stream_of_every_device(monkeypatch):
    """A replica copying another replica's tensor (SyncBatchNorm's merge) must order the copy
    after the work on the source's stream: the caller's, not the source device's default."""
    cuda = _FakeCudaStreams()
    for name in ("current_stream", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    devices = ["cuda:0", "cuda:1", "cuda:2"]

    class Look(nn.Module):
        def forward(self, x):
            return cuda.state()["device"], [cuda.current_stream(d) for d in devices]

    with contextlib.ExitStack() as callers:
        for d in devices:
            callers.enter_context(cuda.stream(f"caller's {d}"))
        seen = parallel_apply([Look() for _ in devices], [torch.ones(1)] * 3, devices=devices)
    assert [index for index, _ in seen] == [0, 1, 2]  # each on its own device
    assert all(streams == [f"caller's {d}" for d in devices] for _, streams in seen)


def test_replica_threads_never_make_a_gpu_the_run_does_not_use_current(monkeypatch):
    """A fresh thread's current device is cuda:0; a stream context entered there would make
    cuda:0 current again on exit (a cudaSetDevice, which makes a CUDA context on it) in a run
    on cuda:1,2 alone. The replica's own device is entered first."""
    cuda = _FakeCudaStreams()
    for name in ("current_stream", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    devices = ["cuda:1", "cuda:2"]

    class Look(nn.Module):
        def forward(self, x):
            return cuda.state()["device"]

    with cuda.stream("caller's cuda:1"), cuda.stream("caller's cuda:2"):
        cuda.set_devices.clear()
        assert parallel_apply([Look(), Look()], [torch.ones(1)] * 2, devices=devices) == [1, 2]
        assert cuda.set_devices and 0 not in cuda.set_devices, cuda.set_devices



def test_a_single_replica_runs_inline_on_its_own_device(monkeypatch):
    """Run inline, one replica still has its device made the current one, as in a thread:
    code that allocates on "the" CUDA device (``device="cuda"``) must land on the replica's,
    also on a step where only the second GPU got samples."""
    cuda = _FakeCudaStreams()
    for name in ("current_stream", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))

    class Look(nn.Module):
        def forward(self, x):
            return cuda.state()["device"]

    assert parallel_apply([Look()], [torch.ones(1)], devices=["cuda:1"]) == [1]
    assert cuda.state()["device"] == 0  # the caller's again

@pytest.mark.cuda
def test_cuda_replica_threads_take_the_callers_streams_of_every_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    streams = [torch.cuda.Stream(d) for d in devices]

    class Look(nn.Module):
        def forward(self, x):
            return torch.cuda.current_device(), [torch.cuda.current_stream(d) for d in devices]

    with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
        seen = parallel_apply([Look(), Look()], [torch.ones(1)] * 2, devices=devices)
    assert [index for index, _ in seen] == [0, 1]
    assert all(found == streams for _, found in seen)

class Boom(nn.Module):
    def __init__(self, bad, exc):
        super().__init__()
        self.bad, self.exc = bad, exc

    def forward(self, x):
        if context.current().index == self.bad:
            raise self.exc
        return x


def test_exception_keeps_type_and_names_the_replica():
    with pytest.raises(KeyError, match="replica 1 on cpu") as info:
        parallel_apply([Boom(1, KeyError("missing"))] * 3, [torch.ones(1)] * 3, devices=["cpu"] * 3)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(ZeroDivisionError, match="replica 0 on cpu"):
        parallel_apply([Boom(0, ZeroDivisionError("x"))], [torch.ones(1)])


class NeedsTwo(Exception):
    def __init__(self, code, detail):
        super().__init__(code, detail)
        self.code = code


def test_exception_that_cannot_be_rebuilt_from_a_message():
    with pytest.raises(NeedsTwo) as info:
        parallel_apply([Boom(1, NeedsTwo(7, "bad"))] * 2, [torch.ones(1)] * 2)
    assert info.value.code == 7
    assert "replica 1 on cpu" in str(info.value) + " ".join(getattr(info.value, "__notes__", []))


@pytest.mark.timeout(60)
def test_failure_while_others_wait_at_a_rendezvous_raises_instead_of_hanging():
    class Meet(nn.Module):
        def forward(self, x):
            ctx = context.current()
            if ctx.index == 2:
                raise ValueError("replica two broke")
            return ctx.group.combine("sum", ctx.index, x, lambda xs: [sum(xs)] * len(xs))

    with pytest.raises(ValueError, match="replica 2 on cpu: replica two broke"):
        parallel_apply([Meet() for _ in range(3)], [torch.ones(1)] * 3, devices=["cpu"] * 3)


def test_aborted_is_reported_only_without_a_real_error():
    class Abort(nn.Module):
        def forward(self, x):
            raise ReplicaAborted("stopped")

    with pytest.raises(ReplicaAborted, match="replica 0 on cpu"):
        parallel_apply([Abort(), Abort()], [torch.ones(1)] * 2)


def test_pool_survives_many_calls_and_errors():
    for _ in range(20):
        with pytest.raises(RuntimeError):
            parallel_apply([Boom(0, RuntimeError("x"))] * 2, [torch.ones(1)] * 2)
    outs = parallel_apply([nn.Identity()] * 2, [torch.ones(1), torch.zeros(1)])
    assert [o.item() for o in outs] == [1.0, 0.0]


def test_length_mismatch_is_value_error():
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply([nn.Identity()] * 2, [torch.ones(1)])


@pytest.mark.timeout(60)
def test_forked_child_starts_a_fresh_pool():
    import multiprocessing

    parallel_apply([nn.Identity()] * 2, [torch.ones(1)] * 2)  # the parent's pool has workers
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_runs_parallel_apply, args=(queue,))
    child.start()
    try:
        child.join(30)
        assert child.exitcode == 0 and queue.get(timeout=5) == [1.0, 2.0]
    finally:
        if child.is_alive():  # it hung on the parent's dead pool
            child.kill()
            child.join()


def _child_runs_parallel_apply(queue):
    outs = parallel_apply([nn.Identity()] * 2, [torch.ones(1), 2 * torch.ones(1)])
    queue.put([o.item() for o in outs])
