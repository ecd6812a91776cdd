"""The first day, again (issue 32): what a new user met, through the CLI and tandem.fit,
against the one-line errors and run directories the README promises."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, SUPPORT, hint_of, one_line_error, run_in_process, run_tandem
from own_model import Net, Pairs

import tandem
from tandem.errors import UsageError

TINY = ("-a", "cifar_resnet20", "--data", "digits", "-b", "16", "--image-size", "8",
        "--no-progress")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A digits run of 1 of its 2 epochs (2 steps, so resumable): copied by each test."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    result = run_in_process("train", *TINY, "--epochs", "2", "--max-steps", "2", "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    import shutil
    shutil.copytree(tiny_run, tmp_path / "run")
    return tmp_path / "run"


# -- 1: labels out of range -------------------------------------------------------------------
LABELS = '''
import torch

class Listed(torch.utils.data.Dataset):
    """Pairs that list their targets (as torchvision's do)."""
    def __init__(self, targets):
        self.targets = list(targets)
    def __len__(self):
        return len(self.targets)
    def __getitem__(self, i):
        return torch.full((1, 8, 8), float(i % 4)), self.targets[i]

def listed():
    return Listed([0, 1, 2, 3, 7, 1]), Listed([0, 1, 2, 3]), ["a", "b", "c", "d"]

def negative():  # plain lists, no names: the class count is read from the labels
    pairs = [(torch.full((1, 8, 8), float(i)), t) for i, t in enumerate([0, 1, 2, 3, -1, 1])]
    return pairs, pairs[:4]

def late():  # the bad label is not the first: met as the batch is read
    pairs = [(torch.full((1, 8, 8), float(i)), t) for i, t in enumerate([0, 1, 2, 3, 7, 1])]
    return pairs, pairs[:4], ["a", "b", "c", "d"]

def good():
    pairs = [(torch.full((1, 8, 8), float(i)), i % 4) for i in range(6)]
    return pairs, pairs[:4], ["a", "b", "c", "d"]

def a_list():
    return [1, 2]
'''


@pytest.fixture
def labels_module(tmp_path, monkeypatch):
    name = f"labels_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(LABELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def own(*argv):
    """``tandem train`` of own_model's net (importable from the repository's root)."""
    return run_in_process("train", "-a", "own_model:make_net", "-b", "2", "--epochs", "1",
                          "--no-progress", *argv)


@pytest.mark.parametrize("factory, words", [("listed", ("[4] has target 7", "4 classes")),
                                            ("negative", ("[4] has target -1",))])
def test_labels_out_of_range_are_one_line_before_the_run(labels_module, factory, words,
                                                         tmp_path):
    result = own("--data", f"{labels_module}:{factory}", "--out", tmp_path / "bad")
    one_line_error(result, *words)
    assert not (tmp_path / "bad").exists()  # refused before it wrote


def test_a_label_met_late_leaves_a_directory_a_fresh_run_can_use(labels_module, tmp_path):
    out = tmp_path / "bad3"
    one_line_error(own("--data", f"{labels_module}:late", "--out", out), "[4] has target 7")
    assert not (out / "run.lock").exists()  # released on the way out
    result = own("--data", f"{labels_module}:good", "--out", out)  # no --overwrite needed
    assert result.returncode == 0, result.stderr
    assert (out / "checkpoint.pt").exists()


def test_a_factory_returning_a_list_says_what_it_returned(labels_module, tmp_path):
    line = one_line_error(own("--data", f"{labels_module}:a_list", "--out", tmp_path / "x"))
    assert "an int" in line and "a int" not in line


# -- 2: a tandem.fit run resumed from the CLI -------------------------------------------------
@pytest.fixture
def fit_run(tmp_path, monkeypatch):
    monkeypatch.chdir(SUPPORT)  # own_model:pairs
    torch.manual_seed(0)
    tandem.fit(Net(), Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10, epochs=1,
               no_progress=True, out=str(tmp_path / "fit1"))
    return tmp_path / "fit1"


def test_a_fit_run_resumed_from_the_cli_says_how_to_continue_it(fit_run):
    line = one_line_error(run_in_process("train", "--resume", fit_run, "--epochs", "2"),
                          "tandem.fit(", f"resume='{fit_run}'", "--data package.module:function")
    assert "would change the run" not in line
    result = run_in_process("train", "--resume", fit_run, "--epochs", "2",
                            "--data", "own_model:pairs")  # the rule the line gives: it works
    assert result.returncode == 0, result.stderr
    assert "epoch 2/2" in result.stdout


def test_a_finished_fit_run_suggests_a_call_that_works(fit_run, capsys):
    row = tandem.fit(Net(), Pairs(30, seed=0), Pairs(11, seed=1), resume=str(fit_run))
    out = capsys.readouterr().out
    assert f"tandem.fit(..., resume='{fit_run}', epochs=N)" in out and row["epoch"] == 1
    result = run_in_process("train", "--resume", fit_run, "--data", "own_model:pairs")
    assert result.returncode == 0, result.stderr
    suggested = result.stdout.strip().split(": ", 1)[1].split(" (N >")[0]
    assert "--data own_model:pairs" in suggested  # the command names what it needs
    argv = suggested.replace("N", "2").split()[1:]
    assert run_in_process(*argv).returncode == 0


def test_a_sequential_handed_to_fit_is_evaluated_with_a_factory(tmp_path, monkeypatch):
    monkeypatch.chdir(SUPPORT)  # own_model:pairs
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    tandem.fit(seq, Pairs(30, seed=0), Pairs(11, seed=1), batch_size=10, epochs=1,
               no_progress=True, out=str(tmp_path / "seq"))
    one_line_error(run_in_process("eval", "--resume", tmp_path / "seq", "--data",
                                  "own_model:pairs"), "Sequential", "-a package.module:function")
    name = f"seq_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(64, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_in_process("eval", "--resume", tmp_path / "seq", "--data", "own_model:pairs",
                            "-a", f"{name}:make")  # what the line says works
    assert result.returncode == 0, result.stderr


# -- 5, 6: read-only run directories and files ------------------------------------------------
def read_only(monkeypatch, *paths):
    """``os.access`` says ``paths`` are read-only (the tests may run as root, which
    ``chmod`` does not stop)."""
    real, denied = os.access, {os.path.abspath(p) for p in paths}
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        False if mode & os.W_OK and os.path.abspath(p) in denied else real(p, mode, **kw)))


def test_a_read_only_run_directory_is_one_line(run_copy, monkeypatch):
    read_only(monkeypatch, run_copy)
    one_line_error(run_in_process("train", "--resume", run_copy, "--max-steps", "3"),
                   "read-only", str(run_copy))


def test_a_read_only_checkpoint_is_refused_before_any_work(run_copy, monkeypatch):
    before = (run_copy / "config.json").read_text()
    read_only(monkeypatch, run_copy / "checkpoint.pt")
    one_line_error(run_in_process("train", "--resume", run_copy, "--epochs", "3",
                                  "--max-steps", "3"), "checkpoint.pt", "read-only")
    assert (run_copy / "config.json").read_text() == before


def test_config_changes_only_with_the_checkpoint_that_needs_them(run_copy, monkeypatch):
    from tandem import checkpoint

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save", fail)
    # the writer's thread fails; the run says so in one line, the file named
    one_line_error(run_in_process("train", "--resume", run_copy, "--epochs", "3",
                                  "--max-steps", "3"), "could not write", "checkpoint.pt",
                   "disk full")
    assert json.loads((run_copy / "config.json").read_text())["optim"]["epochs"] == 2
    monkeypatch.undo()
    assert "at epoch 1/2" in run_in_process("train", "--resume", run_copy, "--max-steps",
                                            "3").stdout


# -- 7: one run at a time in a run directory ---------------------------------------------------
def lock(run, pid):
    (run / "run.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))


def test_a_second_run_into_a_directory_in_use_is_refused(run_copy):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock(run_copy, owner.pid)
        before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
        for argv in (("--resume", run_copy, "--max-steps", "3"), (*TINY, "--out", run_copy, "--overwrite")):
            one_line_error(run_in_process("train", *argv), "in use", f"process {owner.pid}")
        assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before
    finally:
        owner.kill()
        owner.wait()


def test_a_lock_written_in_two_steps_is_waited_for(tmp_path, monkeypatch):
    """Where hard links are not supported the lock is created, then written: a rank that reads
    it empty in between waits for its content instead of refusing (the writer here is a
    thread that takes 0.3 s between the two)."""
    import threading

    from tandem.distributed.env import Place
    from tandem.train import runlock
    from tandem.train.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.create()
    launch_a, launch_b = Place(launch_id="launch-a"), Place(launch_id="launch-b")
    # rank 0 of the same launch; a live process (the parent), so that the negative control
    # below is refused for its launch, not let through as a stale lock of an ended pid
    owner = dict(runlock._me(launch_a), pid=os.getppid())
    created = threading.Event()

    def rank0():
        with open(run.lock_file, "w", encoding="utf-8") as f:
            created.set()
            threading.Event().wait(0.3)
            json.dump(owner, f)

    writer = threading.Thread(target=rank0)
    writer.start()
    created.wait(10)
    runlock.check_free(run, launch_a)  # no UsageError: it read the content once written
    writer.join(10)
    with pytest.raises(UsageError, match=f"in use by process {owner['pid']}"):
        runlock.check_free(run, launch_b)  # the negative control: another launch is refused


def test_an_unreadable_lock_is_one_line_that_says_so(run_copy):
    (run_copy / "run.lock").write_text("")  # e.g. a crash between creating and writing it
    one_line_error(run_in_process("train", "--resume", run_copy, "--max-steps", "3"),
                   "names no owner", f"remove {run_copy / 'run.lock'}")
    assert (run_copy / "run.lock").read_text() == ""  # left for the user to judge


def test_a_stale_lock_is_taken_over_and_said(run_copy):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    lock(run_copy, ended.pid)
    result = run_in_process("train", "--resume", run_copy, "--max-steps", "3")
    assert result.returncode == 0, result.stderr
    assert f"took over {run_copy / 'run.lock'} from process {ended.pid}" in result.stdout
    assert not (run_copy / "run.lock").exists()  # released at the end


def test_the_lock_is_held_while_the_run_writes(tmp_path, monkeypatch):
    from tandem.train.loop import Trainer

    seen = []
    real = Trainer.save

    def save(self, *args, **kwargs):
        seen.append(json.loads((tmp_path / "run" / "run.lock").read_text())["pid"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save", save)
    result = run_in_process("train", *TINY, "--epochs", "1", "--max-steps", "1", "--out",
                            tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert seen == [os.getpid()] and not (tmp_path / "run" / "run.lock").exists()


def test_another_rank_reading_the_lock_as_it_is_written_is_never_refused(tmp_path,
                                                                        monkeypatch):
    """CI saw a torchrun restart's rank 1 refused by rank 0's lock ("in use by process ? on
    ?"): it read the file between its creation and its content. Every moment the lock is
    written, rank 1 of the same launch looks, and must be let through. The negative control:
    a lock of another launch, read the same way, is refused."""
    from tandem.distributed.env import Place
    from tandem.train import runlock
    from tandem.train.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    launch_a = Place(launch_id="launch-a")
    real_dump, looks = json.dump, []

    def rank1_looks(launch):
        me = dict(runlock._me(launch_a), pid=os.getpid() + 1, launch=launch)
        with monkeypatch.context() as m:
            m.setattr(runlock, "_me", lambda place: me)
            try:
                runlock.check_free(run)
                looks.append("let through")
            except UsageError as e:
                looks.append(str(e))

    def dump(obj, f, *args, **kwargs):  # rank 1 looks before and after each write
        rank1_looks("launch-a")
        real_dump(obj, f, *args, **kwargs)
        f.flush()
        rank1_looks("launch-a")

    monkeypatch.setattr(json, "dump", dump)
    with runlock.held(run, launch_a):
        assert looks and set(looks) == {"let through"}, looks
        monkeypatch.setattr(json, "dump", real_dump)
        rank1_looks("launch-b")  # another launch: refused, naming rank 0
        assert f"in use by process {os.getpid()} on {socket.gethostname()}" in looks[-1]
    assert not os.path.exists(run.path)  # no lock and no side file left: removed, as empty


def test_the_os_lock_outlives_the_record_and_dies_with_its_process(tmp_path, monkeypatch):
    """The owner holds an OS lock on run.lock; the kernel releases it when the owner dies,
    however it dies (here SIGKILL: no finally runs, the file stays). A record that says its
    owner held the OS lock is judged by the kernel, not by its pid: a live process under that
    pid (a pid reused) does not keep it."""
    from tandem.distributed.env import LAUNCH_ID_VAR
    from tandem.train import runlock
    from tandem.train.rundir import RunDir

    monkeypatch.delenv(LAUNCH_ID_VAR, raising=False)
    run = RunDir(str(tmp_path / "run"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tandem.train import runlock, rundir\n"
         f"with runlock.held(rundir.RunDir({run.path!r})):\n"
         "    print('held', flush=True)\n    time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                 if k != LAUNCH_ID_VAR})
    try:
        assert holder.stdout.readline() == "held\n"
        assert json.loads(open(run.lock_file).read())["locked"] is True
        with pytest.raises(UsageError, match=f"in use by process {holder.pid}"):
            runlock.check_free(run)
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(run.lock_file)  # left behind, but its OS lock is gone
    runlock.check_free(run)  # no UsageError
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # the record names a live pid, but no process holds the OS lock: taken over
        with open(run.lock_file, "w", encoding="utf-8") as f:
            json.dump({"pid": sleeper.pid, "host": socket.gethostname(), "locked": True}, f)
        runlock.check_free(run)
        lock(tmp_path / "run", sleeper.pid)  # the negative control: a record alone, no "locked"
        with pytest.raises(UsageError, match=f"in use by process {sleeper.pid}"):
            runlock.check_free(run)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_fit_refuses_a_directory_in_use(run_copy):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock(run_copy, owner.pid)
        with pytest.raises(UsageError, match="in use"):
            tandem.fit(Net(), Pairs(30, seed=0), None, out=str(run_copy), overwrite=True)
    finally:
        owner.kill()
        owner.wait()


# -- rough edges ---------------------------------------------------------------------------------
def test_make_demo_and_the_readme_say_how_to_reach_tandem():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # also when make test runs the suite
    assert "source .venv/bin/activate" in dry.stdout.splitlines()[-1]
    readme = open(ROOT / "README.md", encoding="utf-8").read()
    two_commands = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in two_commands and ".venv/bin/tandem" in two_commands


def test_a_module_not_found_says_where_modules_are_looked_for():
    result = run_in_process("train", "-a", "no_such_mod_32:make", "--data", "digits")
    assert "no_such_mod_32" in one_line_error(result, "current directory", "PYTHONPATH")
    assert os.getcwd() in hint_of(result)


def test_a_module_given_as_arch_is_told_to_name_its_function():
    one_line_error(run_in_process("train", "-a", "own_model", "--data", "digits"),
                   "own_model:FUNCTION")
    one_line_error(run_in_process("train", "-a", "zzzz", "--data", "digits"),
                   "package.module:function")


def test_flat_inputs_into_a_conv_net_say_the_shape_the_model_got(tmp_path):
    flat = [(torch.randn(64), i % 3) for i in range(12)]
    with pytest.raises(UsageError, match=r"got a batch of shape \(1, 64\)"):
        tandem.fit(Net(), flat, flat[:4], out=str(tmp_path / "flat"), no_progress=True)
    assert not (tmp_path / "flat" / "config.json").exists()


@pytest.mark.parametrize("argv, words", [
    (("--split", "-1,2"), ("--split", "--flag=VALUE")),
    (("--epochs", "abc"), ("--epochs", "invalid int value")),
    (("--data", "digts"), ("did you mean digits?",)),
    (("--momentum", "5"), ("--momentum 5", "[0, 1)")),
])
def test_a_bad_flag_is_one_line(argv, words, tmp_path):
    result = run_in_process("train", "-a", "cifar_resnet20", *argv, "--out", tmp_path / "r")
    lines = result.stderr.strip().splitlines()  # one line, maybe a hint under it
    assert result.returncode == 2 and len(lines) in (1, 2), result.stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), result.stderr
    assert "usage:" not in result.stderr and all(w in result.stderr for w in words)
    assert not (tmp_path / "r").exists()


def test_tandem_models_into_a_closed_pipe_ends_quietly():
    from conftest import cli_env
    # one model: its table's three lines are writes enough (the whole zoo costs seconds)
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "models", "cifar_resnet20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                            text=True)
    proc.stdout.close()  # as `| head` does once it has its lines: every write meets EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Broken" not in err, err


def test_a_ddp_launch_is_refused_by_a_live_lock_on_every_rank(tmp_path):
    """A live lock of another process refuses every rank in one line, before any process
    group. (That rank 1 does not refuse rank 0's own lock, the same launch, every ddp launch
    into a run directory shows; test_first_day_resume's checks that no lock is left.)"""
    job = ("launch", "--nproc-per-node", "2", "--", "train", *TINY, "--strategy", "ddp",
           "--devices", "cpu", "--epochs", "1", "--max-steps", "2")
    (tmp_path / "run").mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(240)"])
    try:
        lock(tmp_path / "run", owner.pid)
        result = run_tandem(*job, "--out", tmp_path / "run", "--overwrite", timeout=240)
        assert result.returncode != 0 and f"in use by process {owner.pid}" in result.stderr
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert os.listdir(tmp_path / "run") == ["run.lock"]  # nothing written
    finally:
        owner.kill()
        owner.wait()


def test_eval_of_a_run_held_by_its_own_launch_is_not_refused_as_in_use(tmp_path):
    """``tandem launch -- eval RUN`` beside the same launch's training: the lock is its own
    (the launch id eval's plan read), so it is not the "in use" refusal; another launch is."""
    from tandem.config import ParallelConfig
    from tandem.distributed.env import LAUNCH_ID_VAR, Environment, place_of
    from tandem.train.evaluate import evaluate
    from tandem.train.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, time\nfrom tandem.train import runlock, rundir\n"
         "from tandem.distributed.env import Environment, place_of\n"
         f"with runlock.held(rundir.RunDir({run.path!r}), place_of(Environment.read())):\n"
         "    print('held', flush=True)\n    time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, LAUNCH_ID_VAR: "launch-a"})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UsageError, match="in use by .* no checkpoint yet"):
            evaluate(run.path, parallel=ParallelConfig(),
                     place=place_of(Environment({LAUNCH_ID_VAR: "launch-b"})))
        with pytest.raises(Exception) as own:
            evaluate(run.path, parallel=ParallelConfig(),
                     place=place_of(Environment({LAUNCH_ID_VAR: "launch-a"})))
        assert "in use" not in str(own.value) and run.path in str(own.value)
    finally:
        holder.kill()
        holder.wait()
