import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent  # this folder: unit/, integration/, support/
ROOT = TESTS.parent  # the repository
SUPPORT = TESTS / "support"  # the helper modules (on sys.path: pyproject's pythonpath)

# bf16 autocast runs (emulated, slower) on a CPU without bf16 instructions too: the --amp tests
# run on every CPU (read by tandem.distributed.env.cpu_bf16_override, which the callers of
# tandem.precision pass on), and the refusal is tested by faking tandem.precision.cpu_flags.
os.environ["TANDEM_CPU_BF16"] = "1"


# The extended tier (marker `extended`): `make test` (and CI) leaves these out, `make test-all`
# runs them. Each is a second route to what a test of the default tier already shows, or a tool
# of the repository's (a benchmark under torchrun, the GPU check's dry run, torch.compile's C++
# build), and each costs 10 s to 40 s of a 2-core machine; the default tier keeps `make test`
# on a fresh clone under 15 minutes. Listed here, in one place, with what covers them.
EXTENDED = {
    "integration/cli/test_gpu_check.py::test_the_dry_run_writes_a_summary_and_the_json":
        "the script's own dry run (its argument checks stay in the default tier)",
    "integration/cli/test_first_day_resume.py::test_a_ddp_run_resumed_without_launch_says_how":
        "the resume line's wording is tested in-process",
    "integration/torchrun/test_determinism.py::test_two_process_ddp_gives_the_same_bits_twice":
        "every bitwise resume test runs a straight run against a resumed one",
    "integration/two_machines/test_two_machines.py::test_a_lost_rank_0_ends_in_true_lines_and_a"
    "_bitwise_resume_or_a_refusal[no_save_every]": "its [save_every_4] form",
    "integration/two_machines/test_two_machines.py::test_max_restarts_after_losing_rank_0_continu"
    "es_from_its_last_checkpoint[no_save_every]": "its [save_every_4] form",
    "integration/torchrun/test_launch_lifecycle.py::test_sigkilled_worker_restarted_by_torchrun_"
    "finishes_equal_to_the_straight_run": "the NCCL failure model's [max_restarts_1] form and the "
    "two-machine restarts",
    "integration/torchrun/test_launch.py::test_sigkill_of_rank0_keeps_last_checkpoint_and_every_"
    "rank_resumes": "the two-machine lost rank 0",
    "integration/cli/test_cli_train.py::test_two_process_ddp_reaches_the_same_weights":
        "test_launch's ddp --sync-bn run against single (and the recipe's, dropout's, mixing's)",
    "integration/torchrun/test_launch.py::test_hung_worker_times_out":
        "silence past --dist-timeout: the two-machine partition test",
    "integration/two_machines/test_two_machines.py::test_the_rendezvous_endpoint_form_starts_whe"
    "re_the_host_name_is_loopback": "the --master-addr form of the other two-machine tests",
    "integration/two_machines/test_two_machines.py::test_max_restarts_with_a_killed_worker_under"
    "_slurm_finishes_bitwise": "the restarts after a lost rank 0 and SLURM's variables' unit tests",
    "integration/cli/test_amp_cpu.py::test_bench_variants_reach_the_torchrun_phase":
        "the bench's variants in one process (test_bench_variants_race_fp32_cl_amp_and_both_...)",
    "integration/torchrun/test_launch.py::test_two_machines_match_single":
        "the two-machine tests in network namespaces",
    "unit/bench/test_bench.py::test_cli_bench_ddp_and_torch_ddp_run_under_torchrun_on_cpu":
        "the bench's in-process tests",
    "integration/torchrun/test_launch_lifecycle.py::test_bench_torchrun_phase_succeeds_and_its_w"
    "orkers_skip_finalization": "the bench's in-process tests",
    "unit/bench/test_bench_loop.py::test_cli_bench_loop_twin_of_ddp_runs_under_torchrun":
        "the loop twin's in-process tests",
    "unit/strategies/test_compile.py::test_cli_train_compile_then_load_and_eval_uncompiled":
        "torch.compile's C++ build",
    "unit/strategies/test_compile.py::test_compiled_training_matches_eager_and_keeps_plain_keys":
        "torch.compile's C++ build",
    "integration/cli/test_amp_cpu.py::test_with_compile_it_trains_and_evaluates":
        "torch.compile's C++ build",
    "unit/bench/test_bench.py::test_cli_bench_json_every_field":
        "a tool of the repository's (the bench harness, benchmarks/; the command's JSON and "
        "table: test_cli_bench)",
    "unit/bench/test_bench_loop.py::test_cli_bench_loop_races_a_twin_of_every_strategy_with_"
    "its_ratio": "a tool of the repository's (the bench's loop twins; one strategy's twin: "
                 "test_bench_loop's other tests)",
    "integration/cli/test_amp_cpu.py::test_bench_variants_race_fp32_cl_amp_and_both_"
    "interleaved": "a tool of the repository's (the bench's variants; --amp and "
                   "--channels-last training: test_amp_cpu's other tests)",
    "integration/torchrun/test_launch_lifecycle.py::test_under_nccl_s_failure_model_a_lost_"
    "peer_ends_in_one_line_and_goes_on_bitwise[max_restarts_1]":
        "its [no_restart] form (the same line and checkpoint, resumed bitwise) and "
        "test_two_machines' max-restarts continuing from rank 0's last checkpoint",
    "unit/bench/test_bench.py::test_compile_races_a_twin_of_every_contestant":
        "torch.compile's C++ build, in a tool of the repository's (the bench's twins of the "
        "other variants: test_bench_loop, test_amp_cpu's bench variants)",
    "unit/strategies/test_segmentation.py::test_the_example_s_factories_under_launch_then_eval":
        "the example in one process, and the factories under launch (test_factories)",
    "integration/torchrun/test_launch_lifecycle.py::test_sigint_to_a_ddp_launch_saves_where_all_"
    "ranks_stop_then_resumes_exactly": "Ctrl-C on node 1 of two machines, and SIGTERM to one rank",
}


def built_once(tmp_path_factory, name: str, build):
    """``build(directory)``'s result (JSON-able), made once for the whole run. A module
    fixture is built once per pytest-xdist worker that runs one of the module's tests (and again
    when a worker's tests of two modules interleave): the workers share their base temp's parent,
    and the first to come builds while the others wait for it, under a lock."""
    import fcntl
    import json
    import shutil

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root, done = shared / f"once-{name}", shared / f"once-{name}" / "result.json"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return json.loads(done.read_text())
        shutil.rmtree(root, ignore_errors=True)  # a build that failed
        root.mkdir()
        result = build(root)
        done.write_text(json.dumps(result))
        return result


def pytest_collection_modifyitems(config, items):
    no_cuda = not torch.cuda.is_available()
    for item in items:
        node = item.nodeid.removeprefix("tests/")  # a test listed whole, or one parametrization
        if node in EXTENDED or node.split("[")[0] in EXTENDED:
            item.add_marker(pytest.mark.extended)
        if no_cuda and "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (races and runs whose figures it compares)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- shared helpers for tests that run the `tandem` command --------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import psutil  # noqa: E402

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
              "TANDEM_INJECT_FAULT", "TANDEM_LAUNCH_ID")


HOOKS_DIR = str(SUPPORT / "child_hooks")


def with_hooks(env: dict) -> dict:
    """``env`` with ``child_hooks`` first on PYTHONPATH: its subprocesses dump their stacks on
    SIGUSR1 (see ``run_bounded``) and take injected faults."""
    path = os.pathsep.join(p for p in (HOOKS_DIR, env.get("PYTHONPATH")) if p)
    return dict(env, PYTHONPATH=path)


def cli_env(**extra) -> dict:
    """The environment for a `tandem` subprocess: one intra-op thread, no torchrun leftovers,
    and the test hooks (``with_hooks``)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TANDEM_DIST_TIMEOUT="60")
    env.update(extra)
    return with_hooks(env)


def run_bounded(cmd, timeout, env, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion; past ``timeout`` seconds, fail the test
    with every process's Python stacks (SIGUSR1, see child_hooks) and kill all of them, so
    a hang is diagnosable and leaves nothing behind."""
    import signal
    import time

    import pytest

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        everyone = [proc.pid, *descendants(proc.pid)]  # torchrun's workers: own sessions
        for pid in everyone:  # one at a time: dumps written together interleave in the pipe
            _signal_all([pid], signal.SIGUSR1)
            time.sleep(1)  # time to write its stacks
        _signal_all(everyone, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd[2:]))} did not end within {timeout}s; its "
                    f"output:\n{out[-3000:]}\nits stderr, with every process's stacks:\n"
                    f"{err[-12000:]}", pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_all(pids: list[int], sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


def alive(pid: int) -> bool:
    """``pid`` runs (exists and is not a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (each after its parent); [] if ``pid`` is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes other than this one whose command line contains
    ``marker``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if marker in " ".join(p.info["cmdline"] or ()):
            found.append(p.info["pid"])
    return found


def torchrun_workers(marker: str) -> dict[int, int]:
    """{RANK: pid} of the live torchrun workers whose command line contains ``marker``."""
    found = {}
    for pid in processes_with(marker):
        try:
            env = psutil.Process(pid).environ()
        except psutil.Error:  # ended meanwhile, or not ours
            continue
        if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
            found[int(env["RANK"])] = pid
    return found


def run_tandem(*argv, timeout=300, cwd=None, **env) -> subprocess.CompletedProcess:
    """Run `python -m tandem ARGV` to completion (text output captured, hard timeout)."""
    return run_bounded([sys.executable, "-m", "tandem", *map(str, argv)], timeout,
                       cli_env(**env), cwd=cwd)


def run_in_process(*argv) -> subprocess.CompletedProcess:
    """`tandem ARGV` through the CLI's ``main`` in this process, with one intra-op thread as
    ``run_tandem`` gives: the same code without a new interpreter's start-up (seconds each).
    For runs that need no signals, torchrun or a fresh process (those use ``run_tandem``)."""
    import contextlib
    import io

    import torch

    from tandem.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["tandem", *map(str, argv)], code, out.getvalue(),
                                       err.getvalue())


def default_sigint():
    """preexec_fn: SIGINT back to its default (a child inherits an *ignored* SIGINT when pytest
    runs in the background of a non-interactive shell, and Python then never raises it)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def make_image_folder(root, classes=("cat", "dog", "fox"), per_class=8, size=32):
    """A tiny ImageFolder of JPEGs (``root/<class>/<i>.jpg``), each class its own brightness."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.random((size, size, 3)) * 60 + c * 90
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.jpg", quality=90)
    return root


def write_image(path, value, size=(12, 10)):
    """A solid-colour RGB image whose red channel encodes ``value``."""
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    arr[..., 0] = value
    Image.fromarray(arr).save(path)


def write_truncated_png(path):
    """A PNG whose header is intact and whose pixels are cut off."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    arr = (rng.random((32, 32, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def write_cifar(root, n=6):
    """A CIFAR-10 directory as the python version's pickles: 5 training batches and a test
    batch of ``n`` random images each, and batches.meta."""
    import pickle

    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(files):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [(k + i) % 10 for i in range(n)]
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels,
                         b"filenames": [b"x.png"] * n}, f, protocol=2)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)],
                     b"num_vis": 3072}, f, protocol=2)
    return root


def snapshot(run) -> dict:
    """Every file under the run directory ``run`` (``tb/`` too): its bytes and mtime."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


def board_scalars(run) -> dict:
    """Every scalar in ``run/tb``, read by TensorBoard's own reader: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def write_measured(name: str, figures: dict) -> None:
    """A measuring test's figures as ``NAME.json`` in ``$TANDEM_MEASURE_DIR`` when it is set
    (scripts/gpu_check.sh sets it and quotes them in its summary); else nothing."""
    where = os.environ.get("TANDEM_MEASURE_DIR")
    if where:
        import json

        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{name}.json"), "w") as f:
            json.dump(figures, f, indent=1)


def succeeded(result):
    """``result`` (a finished `tandem` command), once it is checked that it exited 0 (a failure
    shows the end of its stderr)."""
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def ok(*argv):
    """`tandem ARGV` run in this process (``run_in_process``), which must succeed."""
    return succeeded(run_in_process(*argv))


@pytest.fixture
def fresh_imagefolder_warnings():
    """imagefolder's once-per-process warnings (a corrupt file, a split) said again in this
    test: for the tests that look for them."""
    from tandem.data import imagefolder

    imagefolder._warned.clear()


def one_line_error(result, *words):
    """``result`` (a finished `tandem` command) failed with exit status 2 and one line on stderr,
    ``tandem: error: ...``, maybe followed by its remedy on a line of its own, ``hint: ...``
    (git's and pip's way); each of ``words`` is in one of them. Returns the error line (the
    hint: :func:`hint_of`)."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("tandem: error:"), result.stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), result.stderr
    for word in words:
        assert any(word in line for line in lines), result.stderr
    return lines[0]


def hint_of(result) -> str | None:
    """The ``hint: ...`` line under a `tandem` command's one-line error, without its
    ``hint: `` (``None``: none)."""
    lines = result.stderr.strip().splitlines()
    return lines[1].removeprefix("hint: ") if len(lines) == 2 and \
        lines[1].startswith("hint: ") else None
