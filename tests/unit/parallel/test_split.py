"""Batch shares by weight (``--split``, ``--max-share``) against `single` on the whole batch.

Shares: the largest-remainder arithmetic, and the chunk sizes each replica actually received
(recorded by a forward pre-hook) equal the declared ones, zero shares included. Exactness:
``--split 3,1``, ``1,0`` and ``auto`` under dp cpu:2, balanced cpu:3 and ddp (2 processes),
each with --sync-bn, reach single's weights after 3 steps (float64, with the noise-floor and
negative controls of tests/support/exact.py); the runs' last batch (2 samples) is smaller than
cpu:3. Auto: per-sample times are injected (``TANDEM_SPLIT_CLOCK``), never measured, so shares and
resumes are reproducible. Errors: one line, exit status 2, before anything runs.
"""

import json
import shutil

import pytest
import torch
from conftest import ok, run_in_process
from ddp_runs import launch_runs, outputs
from exact import check_invariance, same_bits
from torch import nn

from tandem.cli.common import error_line
from tandem.errors import UsageError
from tandem.parallel import (DataParallel, DataParallelCriterion, DataParallelModel,
                             convert_sync_batchnorm)
from tandem.parallel.split import (AutoSplit, BatchSplit, capped, check_max_share, clock_from_spec,
                                   parse_split, shares)

CPU = "cpu"


# -- the arithmetic ----------------------------------------------------------------------------
@pytest.mark.parametrize("batch, weights, expected", [
    (8, (3, 1), [6, 2]),
    (10, (3, 1), [8, 2]),  # 7.5 / 2.5: the tie goes to the lower index
    (7, (1, 0), [7, 0]),
    (2, (1, 1, 1), [1, 1, 0]),  # a batch smaller than the device count
    (5, (1, 1, 1), [2, 2, 1]),  # what the even split gives too
    (0, (2, 1), [0, 0]),
    (100, (0.2, 0.3, 0.5), [20, 30, 50]),
])
def test_shares_are_largest_remainder(batch, weights, expected):
    assert shares(batch, weights) == expected


def test_shares_always_sum_to_the_batch():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 5, (1,), generator=g))
        weights = torch.rand(n, generator=g).tolist()
        batch = int(torch.randint(0, 50, (1,), generator=g))
        sizes = shares(batch, weights)
        assert sum(sizes) == batch and min(sizes) >= 0
        assert sizes == shares(batch, weights)


def test_capped_moves_the_excess_to_devices_under_the_cap():
    assert capped(10, (9, 1), 6) == [6, 4]
    assert capped(12, (1, 1, 10), 5) == [4, 3, 5]
    assert capped(8, (1, 1), None) == [4, 4]


@pytest.mark.parametrize("text, needle", [
    ("3,-1", ">= 0"), ("0,0", "above 0"), ("a,b", "weights like 3,1"), ("1,inf", "finite")])
def test_bad_split_is_one_usage_error(text, needle):
    with pytest.raises(UsageError, match=needle):
        parse_split(text)


def test_max_share_refusals():
    check_max_share(8, (1, 1), 2, 4)  # fits exactly
    with pytest.raises(UsageError, match="at most 8"):
        check_max_share(9, (1, 1), 2, 4)
    with pytest.raises(UsageError, match="device 0 6 of 8"):
        check_max_share(8, (3, 1), 2, 4)


# -- the shares each replica receives ----------------------------------------------------------
def _received(model: nn.Module) -> list:
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("split, batch, expected", [
    ((3, 1), 8, [6, 2]), ((1, 0), 5, [5]), ((0, 1), 5, [5]), ((1, 2, 1), 8, [2, 4, 2]),
    ((1, 1, 1), 2, [1, 1]),
])
def test_replicas_receive_the_declared_shares(split, batch, expected):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    dp = DataParallel(net, [CPU] * len(split), split=split)
    seen = _received(net)
    x = torch.randn(batch, 4)
    out = dp(x)
    assert sorted(seen) == sorted(expected)  # replica threads finish in any order
    assert [n for n in dp.last_shares if n] == expected
    assert dp.last_shares == shares(batch, split)
    torch.testing.assert_close(out, net(x), rtol=0, atol=1e-6)


def test_model_and_criterion_follow_the_split():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    model = DataParallelModel(net, [CPU] * 3, split=(1, 0, 3))
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), [CPU] * 3)
    x, y = torch.randn(9, 4), torch.randint(0, 3, (9,))
    outs = model(x)
    assert [o.shape[0] for o in outs] == [2, 7]
    torch.testing.assert_close(criterion(outs, y), nn.CrossEntropyLoss()(net(x), y),
                               rtol=0, atol=1e-6)


# -- --split auto: injected per-sample times ---------------------------------------------------
def test_auto_converges_to_the_speed_ratio():
    auto = AutoSplit(2)  # device 1 is twice as fast: 2 s per sample against 1 s
    moves = []
    for _ in range(6):
        sizes = shares(30, auto.weights)
        auto.observe(sizes, [2.0 * sizes[0], 1.0 * sizes[1]])
        moves.append(auto.adjust(30))
    assert shares(30, auto.weights) == [10, 20]
    assert moves.index(True) == 1 and sum(moves) <= 2  # after the warm-up, then settled


def test_auto_follows_a_handicap_through_data_parallel(monkeypatch):
    monkeypatch.setenv("TANDEM_SPLIT_CLOCK", "1,3")  # read by the callers, never by the engine
    net = nn.Linear(4, 3)  # replica 0 takes 3x as long per sample:
    dp = DataParallel(net, [CPU, CPU], split="auto", split_clock=clock_from_spec("3,1"))
    seen = []
    for _ in range(4):
        dp(torch.randn(16, 4))
        seen.append(list(dp.last_shares))
    assert seen[0] == [8, 8] and seen[-1] == [4, 12]
    dp.eval()  # no timing outside training
    with torch.no_grad():
        dp(torch.randn(16, 4))
    assert dp.split.auto.seen == 4



def test_auto_takes_its_step_at_the_next_forward_not_inside_this_one(monkeypatch):
    """An owned ``auto`` split reads a forward's spans when the next forward starts: read at
    the end of the forward, a CUDA span waits for the device's work before the backward can
    be queued. And a forward with no tensor to cut is not timed (it crashed)."""
    dp = DataParallel(nn.Linear(4, 3), [CPU, CPU], split="auto")
    steps = []
    real = dp.split.step
    monkeypatch.setattr(dp.split, "step", lambda *a: steps.append(a) or real(*a))
    dp(torch.randn(16, 4))
    assert steps == [] and dp.split.auto.seen == 0
    dp(torch.randn(16, 4))
    assert steps == [(0, 0)] and dp.split.auto.seen == 1

    class FromCount(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, n):
            return self.fc(torch.ones(n, 2))

    plain = DataParallel(FromCount(), [CPU, CPU], split="auto")
    assert plain(3).shape == (3, 2) and plain.split.auto.seen == 0

class _FakeEvent:
    """``torch.cuda.Event`` on the CPU: recorded at a given device time (``clock``)."""

    clock = [0.0]  # the fake device's time, in ms
    streams: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at, self.waited = None, False

    def record(self, stream=None):
        self.streams.append(stream)
        self.at = self.clock[0]

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        assert end.waited, "read before the end event was waited for"
        return end.at - self.at


def test_a_cuda_span_is_the_devices_time_between_two_events(monkeypatch):
    """On CUDA the host returns once kernels are queued: the span is the device's time between
    two events recorded on the device's current stream, read when asked (after waiting)."""
    from tandem.parallel.work_clock import Span, seconds_of

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    _FakeEvent.clock[0], _FakeEvent.streams[:] = 100.0, []
    span = Span(torch.device("cuda:1"))
    _FakeEvent.clock[0] = 350.0  # the device ran 250 ms of the work; the host none of it
    span.stop()
    assert seconds_of(span) == 0.25
    assert _FakeEvent.streams == ["stream of cuda:1"] * 2
    cpu = Span(torch.device("cpu")).stop()
    assert 0 <= seconds_of(cpu) < 60 and seconds_of(1.5) == 1.5


def test_auto_reads_the_spans_at_the_step_not_at_the_forward():
    """A CUDA span is read (a wait for the device) only when the step looks at the records,
    once per step, not in the forward."""
    reads = []

    class Recorded:  # a stopped span
        def __init__(self, seconds):
            self.value = seconds

        def seconds(self):
            reads.append(self.value)
            return self.value

    split = BatchSplit("auto", 2)
    split.sizes(8)
    for i, seconds in enumerate((3.0, 1.0)):
        split.record(i, 4, Recorded(seconds))
    assert reads == []
    split.step(0, 1)
    assert reads == [3.0, 1.0] and split.auto.seen == 1


@pytest.mark.cuda
def test_auto_follows_a_gpu_that_is_slow_on_the_device_not_on_the_host(monkeypatch):
    """Replica 1 keeps its GPU busy (torch.cuda._sleep: no host time): measured on the host,
    both replicas look alike; measured on the device, the shares move to replica 0.

    With one GPU both replicas queue on its one stream, where a span holds whatever was
    queued between its events: replica 1 starts first and replica 0 a clear 50 ms later
    (tests/support/forced_order.py), so that replica 0's span starts after replica 1's sleep."""
    import forced_order

    class Busy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            from tandem.parallel.context import current

            if current() is not None and current().index == 1:
                torch.cuda._sleep(50_000_000)  # tens of ms of device time
            return self.fc(x)

    dp = DataParallel(Busy().cuda(), ["cuda:0", "cuda:0"], split="auto")
    monkeypatch.setattr(forced_order, "STAGGER", 0.05)
    with forced_order.replicas_in_order(monkeypatch, reverse=True):
        for _ in range(6):
            dp(torch.randn(16, 4, device="cuda")).sum().backward()
    share0, share1 = dp.last_shares
    assert share0 > share1, dp.last_shares


# -- exactness: the same update as single, whatever the shares -------------------------------
TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8",
        "--num-classes", "4", "-a", "cifar_resnet20", "-b", "6", "--no-progress", "--seed", "3"]
STEPS = ["--epochs", "2", "--max-steps", "3"]
F64 = ["--dtype", "float64"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    ok("train", *TINY, *STEPS, *F64, "--strategy", "single", "--devices", "cpu",
       "--out", str(out / "f64"))
    ok("train", *TINY, *STEPS, "--strategy", "single", "--devices", "cpu",
       "--out", str(out / "f32"))
    ok("train", *TINY, *STEPS, *F64, "--strategy", "dp", "--devices", "cpu:2",
       "--split", "3,1", "--out", str(out / "negative"))  # no --sync-bn: a different update
    return out


def assert_matches_single(single_run, candidate):
    check_invariance(single_run / "f64" / "checkpoint.pt", {"candidate": candidate},
                     reference32=single_run / "f32" / "checkpoint.pt",
                     negative64=single_run / "negative" / "checkpoint.pt")


THREADED = [("dp", "cpu:2", "3,1"), ("dp", "cpu:2", "1,0"), ("dp", "cpu:2", "auto"),
            ("balanced", "cpu:3", "3,1,0"), ("balanced", "cpu:3", "1,0,0"),
            ("balanced", "cpu:3", "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, devices, split", THREADED)
def test_split_reaches_single_weights(single_run, strategy, devices, split, tmp_path,
                                      monkeypatch):
    monkeypatch.setenv("TANDEM_SPLIT_CLOCK", "1,4,2")  # auto moves the shares after step 2
    ok("train", *TINY, *STEPS, *F64, "--strategy", strategy, "--devices", devices, "--sync-bn",
       "--split", split, "--out", str(tmp_path))
    assert_matches_single(single_run, tmp_path / "checkpoint.pt")
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    n = int(devices.split(":")[1])
    expected = {"auto": shares(6, [1, 1 / 4, 1 / 2][:n])}.get(split) or shares(
        6, [float(w) for w in split.split(",")])
    assert row["split"] == {str(i): s for i, s in enumerate(expected)}


DDP_SPLITS = ["3,1", "1,0", "auto"]
# --max-steps 7: the move decided at step 2 lands in epoch 2 (with -j 1 the loader has drawn 4
# batches ahead)
WORKER_STEPS = ["--epochs", "2", "--max-steps", "7"]
# the resume test: the run straight through, and stopped at step 3 then resumed
RESUME = [*TINY, "--epochs", "2", "--split", "auto", "--sync-bn"]


def _resume_runs(root, args) -> list[tuple[list, bool]]:
    return [(["train", *args, "--max-steps", "6", "--out", root / "straight"], False),
            (["train", *args, "--max-steps", "3", "--out", root / "resumed"], False),
            (["copytree", root / "resumed", root / "stopped"], False),
            (["train", "--resume", root / "resumed", "--max-steps", "6"], False)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Every ddp run of this module, one after the other in ONE 2-process launch
    (tests/support/ddp_runs.py; the launch and its workers' imports cost more than these runs):
    {name: (its directory, rank 0's output)}. Rank 0 is 3x as fast (TANDEM_SPLIT_CLOCK)."""
    root = tmp_path_factory.mktemp("ddp_runs")
    ddp = ["--strategy", "ddp", "--devices", "cpu"]
    named = [(split, ["train", *TINY, *STEPS, *F64, *ddp, "--sync-bn", "--split", split,
                      "--out", root / split]) for split in DDP_SPLITS]
    named.append(("workers", ["train", *TINY, *WORKER_STEPS, *F64, *ddp, "--sync-bn",
                              "--split", "auto", "-j", "1", "--out", root / "workers"]))
    resume = _resume_runs(root / "resume", [*RESUME, *ddp])
    runs = [(argv, False) for _, argv in named] + resume
    result = launch_runs(runs, timeout=480, PYTHONWARNINGS="ignore", TANDEM_SPLIT_CLOCK="1,3")
    assert result.returncode == 0, result.stderr[-3000:]
    found = {name: (root / name, out) for (name, _), out in zip(named, outputs(result.stdout))}
    found["resume"] = (root / "resume", None)
    return found


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("split", DDP_SPLITS)
def test_ddp_split_reaches_single_weights(single_run, split, ddp_runs):
    run, stdout = ddp_runs[split]
    assert_matches_single(single_run, run / "checkpoint.pt")
    if split == "auto":
        assert "split 5,1" in stdout  # rank 0 is 3x as fast: its share moved up
        assert torch.load(run / "checkpoint.pt", weights_only=True)["split"]["schedule"]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_auto_with_loader_workers_changes_shares_on_every_rank_alike(tmp_path, ddp_runs):
    """With -j 1 the loader has drawn 4 batches ahead: shares move 4 batches after the
    decision, on both ranks (else samples would be lost or doubled, and the weights differ)."""
    for name, extra in {"f64": ["--strategy", "single", *F64],
                        "f32": ["--strategy", "single"],
                        "negative": ["--strategy", "dp", "--devices", "cpu:2", *F64]}.items():
        ok("train", *TINY, *WORKER_STEPS, *extra, "--out", str(tmp_path / name))
    run, stdout = ddp_runs["workers"]
    assert "step 2: split 5,1" in stdout
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["split"]["schedule"] == [[0, 6, [0.75, 0.25]]]  # batch 2 + 4 drawn ahead
    check_invariance(tmp_path / "f64" / "checkpoint.pt", {"ddp": run / "checkpoint.pt"},
                     reference32=tmp_path / "f32" / "checkpoint.pt",
                     negative64=tmp_path / "negative" / "checkpoint.pt")


# -- resume: the shares come back, and so do the bits ----------------------------------------
def _checkpoint(path) -> dict:
    ckpt = torch.load(path, weights_only=True)
    if ckpt.get("epoch_progress"):
        ckpt["epoch_progress"].pop("seconds")
    ckpt["config"]["resolved"].pop("launch_id")
    ckpt.pop("best_acc1")  # the stopped run validated once more, at its stop
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_resume_restores_the_shares_bitwise(strategy, tmp_path, monkeypatch, request):
    if strategy == "dp":
        monkeypatch.setenv("TANDEM_SPLIT_CLOCK", "1,3")
        for argv, _ in _resume_runs(tmp_path, [*RESUME, "--devices", "cpu:2",
                                               "--strategy", "dp"]):
            if argv[0] == "copytree":
                shutil.copytree(argv[1], argv[2])
            else:
                ok(*argv)
        root = tmp_path
    else:  # the same runs and copy, in the module's one 2-process launch
        root = request.getfixturevalue("ddp_runs")["resume"][0]
    stopped = torch.load(root / "stopped" / "checkpoint.pt", weights_only=True)["split"]
    assert stopped["auto"]["weights"] != [1.0, 1.0]  # the shares had moved before the stop
    straight = _checkpoint(root / "straight" / "checkpoint.pt")
    resumed = _checkpoint(root / "resumed" / "checkpoint.pt")
    assert same_bits(straight, resumed) == []


# -- errors: one line, exit status 2, nothing run ----------------------------------------------
ERR = ["--data", "synthetic", "--synthetic-size", "8", "--image-size", "8", "--num-classes",
       "2", "-b", "6", "--no-progress", "--max-steps", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("argv, needles", [
    (["--strategy", "dp", "--devices", "cpu:2", "--split", "3,1,1"], ["3 weight(s)", "2 device"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--split=-1,2"], ["--split", ">= 0"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--split", "0,0"], ["--split", "above 0"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--split", "fast"], ["--split", "auto"]),
    (["--strategy", "single", "--devices", "cpu", "--split", "1"], ["--split", "dp"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--max-share", "2"],
     ["--max-share 2", "at most 4"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--split", "5,1", "--max-share", "4"],
     ["--split 5,1", "device 0", "--max-share 4"]),
    (["--strategy", "dp", "--devices", "cpu:2", "--max-share", "0"], ["--max-share"]),
])
def test_split_errors_are_one_line(argv, needles, tmp_path):
    result = run_in_process("train", *ERR, *argv, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("tandem: error: "), result.stderr  # one line, then maybe a hint
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), result.stderr
    for needle in needles:
        assert needle in " ".join(lines), lines
    assert not (tmp_path / "out").exists()


def test_auto_adjusts_once_a_new_epoch_begins():
    auto = AutoSplit(2, threshold=10.0)
    for step in range(4):
        auto.at_epoch(0)
        auto.observe([4, 4], [4.0, 4.0 * 1.5])  # device 1 is slower, under the threshold
        auto.adjust()
    assert auto.weights == [1.0, 1.0]  # below the threshold: nothing moved within the epoch
    auto.at_epoch(1)
    assert auto.adjust() and shares(10, auto.weights) == [6, 4]


def _noisy_run(per_sample, spread, steps=300, batch=32, seed=0):
    """Feed AutoSplit ``steps`` steps of chunk times ``share * per_sample`` scaled by uniform
    noise of +-``spread``; the moves (True per moved step) and the last shares."""
    g = torch.Generator().manual_seed(seed)
    auto, moves = AutoSplit(len(per_sample)), []
    for _ in range(steps):
        sizes = shares(batch, auto.weights)
        noise = 1 + spread * (2 * torch.rand(len(sizes), generator=g) - 1)
        auto.observe(sizes, [n * p * float(f) for n, p, f in zip(sizes, per_sample, noise)])
        moves.append(auto.adjust(batch))
    return moves, shares(batch, auto.weights)


def test_auto_keeps_the_equal_split_under_noise():
    runs = [_noisy_run([1.0, 1.0], 0.5, seed=seed) for seed in range(10)]  # chunks 0.5x-1.5x
    assert sum(sum(moves) for moves, _ in runs) <= 3  # at most 1 move per 1,000 steps
    assert all(last == [16, 16] for _, last in runs)


@pytest.mark.parametrize("seed", range(3))
def test_auto_still_follows_a_real_imbalance_under_noise(seed):
    moves, last = _noisy_run([2.0, 1.0], 0.5, seed=seed)  # device 1 twice as fast
    assert moves.index(True) < 20 and sum(moves) <= 4
    assert last in ([10, 22], [11, 21], [12, 20])


@pytest.mark.parametrize("clock, moved", [("1,1~0.5", False), ("2,1~0.5", True)])
def test_cli_split_auto_moves_only_beyond_the_noise(clock, moved, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_SPLIT_CLOCK", clock)
    result = ok("train", *TINY[:3], "64", *TINY[4:], "--strategy", "dp", "--devices", "cpu:2",
                "--split", "auto", "-b", "4", "--epochs", "2", "--out", str(tmp_path / "run"))
    splits = [ln for ln in result.stdout.splitlines() if ": split " in ln]
    assert bool(splits) == moved and len(splits) <= 2, splits


# -- bench --handicap ------------------------------------------------------------------------
def test_handicap_is_extra_work_on_one_replica_only():
    from tandem_bench.contestants import Handicap

    torch.manual_seed(0)
    net = convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    slow = Handicap(net, 1, 2.5)
    extra = []
    slow._shadow.register_forward_pre_hook(lambda m, args: extra.append(args[0].shape[0]))
    dp = DataParallel(slow, [CPU, CPU], split=(1, 1))
    x = torch.randn(8, 4)
    expected = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    expected.load_state_dict(net.state_dict())
    extra_backward = []
    next(slow._shadow.parameters()).register_hook(lambda g: extra_backward.append(g.shape))
    out = dp(x)
    torch.testing.assert_close(out, expected(x), rtol=0, atol=1e-5)
    assert sorted(extra) == [2, 4]  # replica 1's 4 samples once, then half of them
    torch.testing.assert_close(net[1].running_mean, expected[1].running_mean)  # untouched
    assert extra_backward == []  # the extra passes' backward waits for the replica's own
    out.sum().backward()
    assert len(extra_backward) == 1


@pytest.mark.slow
def test_bench_races_equal_auto_and_ideal_splits(monkeypatch):
    from tandem_bench import BenchConfig, contestants, run_bench

    prepare, forward = contestants.prepare_strategy, contestants.Handicap.forward
    split_of, sizes = {}, {}  # a contestant's handicapped model (its shadow) -> split, chunks

    def spy_prepare(*args, split=None, **kw):
        prepared = prepare(*args, split=split, **kw)
        handicap = next(m for m in prepared[1].modules() if isinstance(m, contestants.Handicap))
        split_of[id(handicap._shadow)] = split
        return prepared

    def spy_forward(self, x):  # replicas share their original's shadow
        if torch.is_grad_enabled():
            sizes.setdefault(split_of[id(self._shadow)], []).append(x.shape[0])
        return forward(self, x)

    monkeypatch.setattr(contestants, "prepare_strategy", spy_prepare)
    monkeypatch.setattr(contestants.Handicap, "forward", spy_forward)
    config = BenchConfig(arch="cifar_resnet20", strategies="dp", devices="cpu:2", batch_size=12,
                         steps=2, warmup=3, baselines="none", handicap="1:3", threads=1)
    assert config.ideal_split() == (1.0, 1 / 3)
    results = {r["name"]: r for r in run_bench(config)["results"]}
    assert list(results) == ["dp", "dp/auto", "dp/ideal"]
    assert all(r["status"] == "ok" for r in results.values())
    # the shares each contestant's replicas really received, step by step
    steps = {k: [sorted(v[i:i + 2]) for i in range(0, len(v), 2)] for k, v in sizes.items()}
    assert set(steps) == {None, "auto", (1.0, 1 / 3)}
    assert steps[None] and all(s == [6, 6] for s in steps[None])
    assert steps[(1.0, 1 / 3)] and all(s == [3, 9] for s in steps[(1.0, 1 / 3)])
    assert steps["auto"] and all(sum(s) == 12 for s in steps["auto"]), steps["auto"]


@pytest.mark.parametrize("handicap", ["2:2", "1", "1:0.5", "x:2"])
def test_bad_handicap_is_one_usage_error(handicap):
    from tandem_bench import BenchConfig

    with pytest.raises(UsageError, match="^bad handicap ") as caught:
        BenchConfig(arch="cifar_resnet20", devices="cpu:2", handicap=handicap)
    assert error_line(caught.value).startswith("bad --handicap ")  # the CLI's words


@pytest.mark.parametrize("name, split", [("dp", (3, 1)), ("balanced", (1, 0, 2)),
                                         ("hybrid", (3, 1)), ("hybrid", (0, 1))])
@pytest.mark.parametrize("batch", [7, 2])
def test_strategies_with_a_split_equal_single_in_process(name, split, batch):
    """The library path (no CLI): outputs, loss and state after two steps, as in
    tests/unit/strategies/test_strategies.py, with the shares given to the strategy."""
    import copy

    from strategy_steps import Tiny, make_batches, run_steps

    from tandem.strategies import create_strategy

    torch.manual_seed(0)
    model = Tiny()
    batches = make_batches(batch)
    ref_outs, ref_state = run_steps(create_strategy("single", [torch.device(CPU)]),
                                    copy.deepcopy(model), batches)
    strategy = create_strategy(name, [torch.device(CPU)] * len(split), sync_bn=True, split=split)
    seen = _received(model.features[0])  # every replica's chunk, by a hook its copies share
    outs, state = run_steps(strategy, model, batches)
    # the two training steps and the evaluation step each split the batch by the weights
    expected = sorted(n for n in shares(batch, split) if n)
    assert [sorted(seen[i:i + len(expected)]) for i in range(0, len(seen), len(expected))] == \
        [expected] * 3, seen
    for (loss, correct, count), (ref_loss, ref_correct, ref_count) in zip(outs, ref_outs):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert (correct, count) == (ref_correct, ref_count)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-4, atol=1e-5)


def test_loader_shares_keep_every_batch_and_its_keys():
    """Ranks' shares by weight cover each global batch exactly, with the same keys (sample,
    seed, epoch) in the same order as the even split: data order and augmentation stay."""
    from tandem.data.loader import ShardedBatchSampler

    def batches(world, split=None):
        per_rank = [list(ShardedBatchSampler(23, 6, shuffle=True, seed=4, epoch=1, rank=r,
                                             world_size=world, split=split))
                    for r in range(world)]
        return [sum(parts, []) for parts in zip(*per_rank)], per_rank

    even, _ = batches(1)
    weighted, per_rank = batches(3, lambda epoch, b, size: shares(size, (3, 0, 1)))
    assert weighted == even
    assert [len(k) for k in per_rank[0]] == [5, 5, 5, 4]  # 6, 6, 6, then the short 5
    assert all(not k for k in per_rank[1])  # weight 0: an empty share every batch


def test_plan_reports_a_split():
    from tandem.hybrid import HybridParallel
    from tandem.models import create_model

    with torch.device("meta"):
        model = create_model("alexnet")
    even = HybridParallel.plan(model, 2, batch_size=64)
    one = HybridParallel.plan(model, 2, batch_size=64, split=(1, 0))
    assert one.dp_bytes["inputs"] == 0 and one.dp_bytes["parameters"] == 0  # no replica
    assert even.dp_bytes["inputs"] > 0
    plan = HybridParallel.plan(model, 2, batch_size=64, split=(2, 1), per_sample=(1.0, 2.0))
    report = plan.report()
    assert "split 43,21 of 64" in report
    assert "expected step (slowest device): 43s; even split 32,32: 64s; ideal split 43,21: 43s" \
        in report
