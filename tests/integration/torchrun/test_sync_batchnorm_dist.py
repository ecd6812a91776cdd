"""SyncBatchNorm across 2 gloo processes (uneven and empty rank batches), threads inside
processes, and under torch's own DistributedDataParallel.

All scenarios run in ONE spawn of 2 processes (importing torch dominates the cost); each rank
saves what it computed and the test compares it with plain BatchNorm on the whole batch.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

WORLD = 2
DEADLINE = 240  # seconds for the whole spawn; a hang fails the test instead of CI
# (name, dims, per-rank sizes, per-thread split of each rank's batch or None, momentum)
BN_CASES = [
    ("uneven_2d", 2, [5, 2], None, 0.1),
    ("empty_rank1_4d", 4, [5, 0], None, 0.3),
    ("empty_rank0_3d", 3, [0, 4], None, None),
    ("uneven_5d", 5, [1, 3], None, 0.1),
    ("threads_in_processes", 4, [5, 3], [[2, 3], [1, 2]], 0.2),
]
DDP_CASES = [("ddp_uneven", [5, 2]), ("ddp_empty_rank", [6, 0])]
# tandem DataParallel over 2 CPU replicas inside each process (each replica's backward in its
# own thread, SyncBatchNorm meeting there and across processes); a rank of 1 sample runs one
DP_CASES = [("dp_in_processes", [5, 3]), ("dp_and_one_replica", [4, 1])]
SHAPES = {2: (3,), 3: (3, 4), 4: (3, 3, 2), 5: (3, 2, 2, 2)}


def case_data(index, dims, total):
    g = torch.Generator().manual_seed(100 + index)
    x = torch.randn((total, *SHAPES[dims]), generator=g) * 3 + 1
    w = torch.randn(x.shape, generator=g)
    weight = torch.rand(3, generator=g) + 0.5
    bias = torch.randn(3, generator=g)
    return x, w, weight, bias


PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def make_bn(sync, dims, momentum, weight, bias):
    bn = (SyncBatchNorm if sync else PLAIN[dims])(3, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    return bn


def conv_net():
    torch.manual_seed(7)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))


def ddp_data(index, total):
    g = torch.Generator().manual_seed(500 + index)
    return torch.randn(total, 3, 6, 6, generator=g) * 2, torch.randint(0, 5, (total,), generator=g)


def rank_slice(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def state_of(module):
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def run_bn_case(rank, device, index, dims, sizes, split, momentum):
    x, w, weight, bias = [t.to(device) for t in case_data(index, dims, sum(sizes))]
    bn = make_bn(True, dims, momentum, weight, bias).to(device)
    mine = x[rank_slice(sizes, rank)].clone().requires_grad_()
    out = None
    for _ in range(2):  # two steps: momentum / num_batches_tracked across steps
        mine.grad = None
        bn.zero_grad()
        if split is None:
            out = bn(mine)
        else:  # replica threads inside each process: threads merge first, then processes
            from replica_threads import run_threads

            outs, errors = run_threads([lambda c=c: bn(c) for c in mine.split(split[rank])],
                                       devices=[device] * len(split[rank]))
            assert errors == [None] * len(outs), errors
            out = torch.cat(outs)
        (out * w[rank_slice(sizes, rank)]).sum().backward()
    return dict(out=out.detach().cpu(), grad=mine.grad.cpu(), weight_grad=bn.weight.grad.cpu(),
                bias_grad=bn.bias.grad.cpu(), state=state_of(bn))


def run_ddp_case(rank, device, index, sizes):
    x, y = [t.to(device) for t in ddp_data(index, sum(sizes))]
    model = convert_sync_batchnorm(conv_net()).to(device)
    ids = [device] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        part = rank_slice(sizes, rank)
        losses = nn.functional.cross_entropy(ddp(x[part]), y[part], reduction="sum")
        # DDP averages gradients over ranks: scale so the average is the global-mean gradient.
        (losses * WORLD / sum(sizes)).backward()
        opt.step()
    return dict(state=state_of(model))


def run_dp_case(rank, device, index, sizes):
    from tandem.parallel import DataParallel

    x, y = [t.to(device) for t in ddp_data(10 + index, sum(sizes))]
    model = convert_sync_batchnorm(conv_net()).to(device)
    part = rank_slice(sizes, rank)
    out = DataParallel(model, [device, device], backward_threads=True)(x[part])
    threaded = any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)
    nn.functional.cross_entropy(out, y[part], reduction="sum").backward()
    return dict(grads={k: p.grad.cpu() for k, p in model.named_parameters()},
                state=state_of(model), threaded=threaded)


def run_one_value_case(rank, device):
    """A global batch of 1 sample (rank 0) + 0 samples (rank 1): both ranks must raise."""
    bn = SyncBatchNorm(3).to(device)
    try:
        bn(torch.randn(1 - rank, 3, device=device))
    except ValueError as exc:
        return str(exc)
    return None


def worker(rank, out_dir, backend):
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False  # compared with a float32 CPU reference
        torch.backends.cuda.matmul.allow_tf32 = False
    # A file store: no port to pick and lose to another program before the workers bind it.
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {}
        for index, (name, dims, sizes, split, momentum) in enumerate(BN_CASES):
            results[name] = run_bn_case(rank, device, index, dims, sizes, split, momentum)
        for index, (name, sizes) in enumerate(DDP_CASES):
            results[name] = run_ddp_case(rank, device, index, sizes)
        for index, (name, sizes) in enumerate(DP_CASES):
            results[name] = run_dp_case(rank, device, index, sizes)
        results["one_value"] = run_one_value_case(rank, device)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Joined a gloo group (directly, not through tandem): end without the interpreter's
    # finalization, which gloo's threads may race (see tandem.exit / exit_process).
    os._exit(0)


def spawn(backend, out_dir):
    """Run ``worker`` in WORLD processes with a hard deadline; return each rank's results."""
    ctx = mp.start_processes(worker, args=(out_dir, backend), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"2-process SyncBatchNorm run did not finish in {DEADLINE}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn("gloo", str(tmp_path_factory.mktemp("syncbn_gloo")))


close = dict(rtol=1e-5, atol=1e-5)


def check_bn_case(rank_results, index):
    name, dims, sizes, _, momentum = BN_CASES[index]
    x, w, weight, bias = case_data(index, dims, sum(sizes))
    ref = make_bn(False, dims, momentum, weight, bias)
    for _ in range(2):
        ref.zero_grad()
        xx = x.clone().requires_grad_()
        out = ref(xx)
        (out * w).sum().backward()
    got = [r[name] for r in rank_results]
    for size, g in zip(sizes, got):  # an empty rank still joined and returned an empty output
        assert g["out"].shape[0] == size
    torch.testing.assert_close(torch.cat([g["out"] for g in got]), out.detach(), **close)
    torch.testing.assert_close(torch.cat([g["grad"] for g in got]), xx.grad, **close)
    # Each rank holds its own samples' share of the parameter gradients.
    torch.testing.assert_close(sum(g["weight_grad"] for g in got), ref.weight.grad, **close)
    torch.testing.assert_close(sum(g["bias_grad"] for g in got), ref.bias.grad, **close)
    for g in got:
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(g["state"][key], value, **close)


def check_ddp_case(rank_results, index):
    name, sizes = DDP_CASES[index]
    x, y = ddp_data(index, sum(sizes))
    ref = conv_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for r in rank_results:
        got = r[name]["state"]
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(got[key], value, **close, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BN_CASES)), ids=[c[0] for c in BN_CASES])
def test_gloo_processes_match_whole_batch(rank_results, index):
    check_bn_case(rank_results, index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DDP_CASES)), ids=[c[0] for c in DDP_CASES])
def test_torch_ddp_with_sync_batchnorm_matches_one_process(rank_results, index):
    check_ddp_case(rank_results, index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DP_CASES)), ids=[c[0] for c in DP_CASES])
def test_data_parallel_replicas_inside_processes_match_one_process(rank_results, index):
    name, sizes = DP_CASES[index]
    x, y = ddp_data(10 + index, sum(sizes))
    ref = convert_sync_batchnorm(conv_net())  # plain batch norm outside a group
    nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    got = [r[name] for r in rank_results]
    # the replicas met in backward threads wherever a rank had 2 samples for its 2 replicas
    assert [g["threaded"] for g in got] == [size > 1 for size in sizes]
    for key, p in ref.named_parameters():  # each rank holds its own samples' share
        torch.testing.assert_close(sum(g["grads"][key] for g in got), p.grad, **close)
    for g in got:
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(g["state"][key], value, **close)


@pytest.mark.slow
def test_global_batch_of_one_value_raises_on_every_rank(rank_results):
    for r in rank_results:
        assert "more than 1 value per channel" in r["one_value"]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="NCCL needs a GPU per process")
def test_nccl_processes_match_whole_batch(tmp_path):
    results = spawn("nccl", str(tmp_path))
    for index in range(len(BN_CASES)):
        check_bn_case(results, index)
    for index in range(len(DDP_CASES)):
        check_ddp_case(results, index)
