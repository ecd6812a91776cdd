"""--strategy auto compared with a named strategy: an injected clock decides the race (no timing
here); the run that follows equals the same run with the choice named, bit for bit; the choice
is recorded once and a resume keeps it."""

import json

import pytest
import torch
from conftest import run_in_process
from exact import same_bits
from own_model import Net, Pairs
from torch import nn

import tandem
from tandem_bench.report import planned_vs_measured
from tandem.precision import amp_precision
from tandem.strategies import auto
from tandem.strategies.step_timer import StrategyStep, placed
from tandem.train import settings

CPU2 = [torch.device("cpu"), torch.device("cpu")]


pytestmark = pytest.mark.usefixtures("one_thread")


class Headless(nn.Module):
    """No Linear head: hybrid cannot split it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


class FakeClock:
    """Seconds that pass only when a contestant's step says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Timed:
    """A real strategy step whose call is ``timed`` instead."""

    def __init__(self, inner, timed):
        self.inner, self.timed, self.devices = inner, timed, inner.devices

    def __call__(self):
        return self.timed()

    def close(self):
        self.inner.close()


def builder(clock, costs, built=None, fail=None, cold=None):
    """Real strategy steps around ``Net`` whose steps each advance ``clock`` by ``costs[name]``
    (the first by ``cold[name]`` where given); ``fail[name]`` is an exception their step
    raises instead."""
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))

    def build(name):
        devices = CPU2[:auto.strategy_class(name).max_devices or 2]
        c = StrategyStep.start(placed(name, Net(), devices, batch), lr=0.01,
                               amp=amp_precision("cpu", False))
        step = c

        def timed():
            if fail and name in fail:
                raise fail[name]
            out = step()
            first = cold is not None and name in cold and not steps
            clock.now += cold[name] if first else costs[name]
            steps.append(1)
            return out

        steps = []

        if built is not None:
            built.append(name)
        return _Timed(c, timed)
    return lambda name: (lambda: build(name))  # placed, then launched (auto.race)


def _race(costs, rounds=3, **kw):
    clock = FakeClock()
    result = auto.race(list(costs), builder(clock, costs, **kw), rounds=rounds,
                       clock=clock)
    return result, auto.choose(result.rows)


def test_the_injected_clock_picks_the_fastest():
    result, (choice, reason) = _race({"single": 3.0, "dp": 1.0, "balanced": 2.0, "hybrid": 1.5})
    assert choice == "dp"
    assert reason == "dp: 1.50x hybrid"
    assert [r["median_s"] for r in result.rows] == [3.0, 1.0, 2.0, 1.5]
    assert result.rounds == 3


def test_a_tie_picks_the_simpler():
    _, (choice, reason) = _race({"single": 1.0, "dp": 1.0, "balanced": 0.99, "hybrid": 0.985})
    assert choice == "single"
    assert "could not tell single, dp, balanced and hybrid apart (its step 1.02x hybrid" in reason
    # overlapping quartiles are a tie too; apart and more than 3% faster is not
    row = lambda n, m, q1, q3: {"name": n, "median_s": m, "q1_s": q1, "q3_s": q3}  # noqa: E731
    assert auto.choose([row("dp", 1.0, 0.8, 1.2), row("hybrid", 0.9, 0.85, 0.95)])[0] == "dp"
    assert auto.choose([row("dp", 1.0, 0.98, 1.02), row("hybrid", 0.9, 0.89, 0.91)])[0] == \
        "hybrid"


def test_the_budget_sets_the_rounds():
    """Each round costs 0.4 s on the fake clock: the cold round spends 0.4 s of the 5 s
    budget, leaving 11 rounds; a cold round of 4.5 s leaves none, and three warm rounds run
    anyway (the fewest a race decides on: a budget may end a race early, not make it
    meaningless). An epoch of 1000 batches makes the budget 5% of an epoch, at most 30 s."""
    costs = {"single": 0.1, "dp": 0.1, "balanced": 0.1, "hybrid": 0.1}
    assert _race(costs, rounds=None)[0].rounds == 11
    result, (choice, _) = _race({"single": 2.0, "dp": 1.0, "balanced": 1.5}, rounds=None)
    assert result.rounds == auto.MIN_ROUNDS == 3 and result.over_budget and choice == "dp"
    assert result.seconds == 4.5 * (1 + auto.MIN_ROUNDS)  # the cold round and three warm ones
    assert "3 timed rounds (past the budget" in auto.format_block(result)
    assert auto.budget_s(1000 * 0.1) == 5.0 and auto.budget_s(200) == 10.0
    assert auto.budget_s(10_000) == 30.0


def test_auto_steps_below_three_still_times_three_rounds():
    result, _ = _race({"single": 2.0, "dp": 1.0}, rounds=1)
    assert result.rounds == auto.MIN_ROUNDS and result.seconds == 3.0 * (1 + auto.MIN_ROUNDS)
    assert "3 timed rounds (--auto-steps 1 raised to 3" in auto.format_block(result)


def test_the_block_shows_the_spread_and_says_when_the_race_cannot_tell_them_apart():
    row = lambda n, m, q1, q3: {"name": n, "median_s": m, "iqr_s": q3 - q1, "q1_s": q1,  # noqa
                                "q3_s": q3}
    rows = [row("single", 4.4853, 1.2, 5.0), row("dp", 0.4881, 0.45, 1.3)]  # issue 46's race
    choice, reason = auto.choose(rows)
    assert choice == "single"
    assert "could not tell single and dp apart" in reason, reason
    result = auto.RaceResult(rows, 3, 20.0, choice, reason)
    lines = auto.format_block(result).splitlines()
    assert lines[1].split()[:4] == ["candidate", "step", "ms", "spread"]
    assert lines[2].split()[:3] == ["single", "4485.3", "85%"], lines[2]  # (5.0 - 1.2) / 4.4853
    apart = [row("single", 2.0, 1.9, 2.1), row("dp", 1.0, 0.95, 1.05)]
    assert "could not tell" not in auto.choose(apart)[1]


def test_the_cold_step_never_decides():
    """dp's first step is slow (allocation, lazy set-up) and single's fast; warm, dp is 3x
    faster. A cold round that uses the whole budget still gets three warm rounds, which pick
    dp; the negative control, judged by the cold times, would pick single."""
    costs, cold = {"single": 3.0, "dp": 1.0}, {"single": 1.0, "dp": 6.0}
    result, (choice, _) = _race(costs, rounds=None, cold=cold)
    assert result.over_budget and result.rounds == auto.MIN_ROUNDS
    assert choice == "dp" and [r["median_s"] for r in result.rows] == [3.0, 1.0]
    cold_only = [{"name": n, "median_s": t, "q1_s": t, "q3_s": t} for n, t in cold.items()]
    assert auto.choose(cold_only)[0] == "single"


def test_only_capable_candidates_are_raced():
    raced, left = auto.candidates(CPU2, Headless())
    assert "hybrid" not in raced and "hybrid" in left
    assert set(raced) == {"single", "dp", "balanced"}
    assert not any(auto.strategy_class(n).multiprocess for n in raced)
    raced, left = auto.candidates(CPU2[:1], Net())
    assert raced == ["single"] and left["dp"] == "one device: nothing to spread"
    refuse = lambda name: "--split needs more" if name == "single" else None  # noqa: E731
    assert "single" not in auto.candidates(CPU2, Net(), check=refuse)[0]


def test_an_out_of_memory_candidate_is_dropped_with_a_word():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    result, (choice, _) = _race({"single": 3.0, "dp": 1.0, "balanced": 2.0},
                                fail={"dp": oom})
    assert choice == "balanced"
    assert {r["name"]: r.get("note") for r in result.rows}["dp"] == "dropped: out of memory"
    result.choice, result.reason = choice, "balanced: 1.50x single"
    block = auto.format_block(result)
    assert "dp        dropped: out of memory" in block and "Traceback" not in block


def test_planned_bytes_and_bench_explain():
    planned = auto.planned_bytes(Net(), CPU2, 8, (1, 8, 8))
    assert planned["single"] == 0 and planned["dp"] > planned["balanced"] > 0
    assert planned["hybrid"] > 0
    assert auto.planned_bytes(Headless(), CPU2, 8, (1, 8, 8)) == {}
    report = {"results": [{"name": "dp", "kind": "strategy", "status": "ok",
                           "bytes_per_step": {"total": 2048}, "step_time_s": {"median": 0.01}},
                          {"name": "bare", "kind": "baseline", "status": "ok"}]}
    text = planned_vs_measured(report, {"dp": 1024})
    assert text.splitlines()[1].split() == ["dp", "1.0K", "2.0K", "10.0"]


def test_under_launch_auto_is_left_to_the_plans_race_and_hybrid_runs_as_hybrid_ddp(
        monkeypatch, capsys):
    from tandem.cli.launch import _check_multiprocess
    from tandem.config import ParallelConfig, TrainConfig
    from tandem.errors import UsageError

    from tandem.distributed.env import Place

    under_torchrun = Place(torchrun=True)  # rank 0 of a torchrun job
    cfg = TrainConfig(parallel=ParallelConfig(strategy="auto", devices="cpu"))
    raced, ckpt, _ = settings.resumed_config(cfg, frozenset({"strategy"}), under_torchrun)
    assert raced.parallel.strategy == "auto" and ckpt is None  # the plan races the processes
    hybrid = TrainConfig(parallel=ParallelConfig(strategy="hybrid", devices="cpu"))
    cfg, _, _ = settings.resumed_config(hybrid, frozenset({"strategy"}), under_torchrun)
    assert cfg.parallel.strategy == "hybrid-ddp" == auto.under_launch("hybrid")
    assert "--strategy hybrid: under tandem launch it runs as hybrid-ddp" in capsys.readouterr().out
    assert auto.under_launch("dp") == auto.launched() == "ddp"
    _check_multiprocess(["train", "--strategy", "auto"])  # launch accepts them
    _check_multiprocess(["train", "--strategy", "hybrid"])
    with pytest.raises(UsageError, match="needs --strategy hybrid, ddp, hybrid-ddp or auto"):
        _check_multiprocess(["train", "--strategy", "dp"])  # N copies of one run: refused


STEPS = dict(batch_size=7, epochs=2, max_steps=3, seed=3, no_progress=True, devices="cpu:2")


def fit(out, threads=1, **settings):
    torch.set_num_threads(threads)
    torch.manual_seed(0)  # the user's model: its initial weights are the user's
    settings = {**STEPS, **settings}
    return tandem.fit(Net(), Pairs(30, seed=0), Pairs(11, seed=1), out=str(out), **settings)


def _checkpoint(out) -> dict:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    ckpt.get("epoch_progress", {}).pop("seconds", None)  # wall-clock, not a result
    ckpt["config"]["resolved"].pop("launch_id")
    ckpt["config"]["resolved"].pop("auto", None)  # the race's record: auto's only
    ckpt["config"]["parallel"].pop("auto_steps")
    return ckpt


def test_fit_auto_equals_the_named_run_bitwise(tmp_path, capsys):
    """fit(strategy="auto") works, records its race, and trains as the choice named does.
    Controls: another lr must differ; another thread count shows the floor (printed)."""
    row = fit(tmp_path / "auto", strategy="auto", auto_steps=3)
    assert row is not None and row["step"] == 3
    out = capsys.readouterr().out
    assert raced(out) == 1 and "chosen:" in out
    record = json.loads((tmp_path / "auto" / "config.json").read_text())
    choice, devices = record["resolved"]["auto"]["choice"], record["parallel"]["devices"]
    assert record["parallel"]["strategy"] == choice
    assert {r["name"] for r in record["resolved"]["auto"]["table"]} == \
        {"single", "dp", "balanced", "hybrid"}
    named = dict(strategy=choice, devices=devices)  # single drives one device of the two
    fit(tmp_path / "named", **named)
    fit(tmp_path / "threads", threads=2, **named)
    fit(tmp_path / "negative", lr=0.051, **named)
    named = _checkpoint(tmp_path / "named")
    assert same_bits(_checkpoint(tmp_path / "auto"), named) == []
    assert same_bits(_checkpoint(tmp_path / "negative"), named) != []
    floor = same_bits(_checkpoint(tmp_path / "threads"), named)
    print(f"auto chose {choice}; 2 threads differ from 1 in {len(floor)} entries")


def test_fit_auto_past_its_budget_decides_on_three_rounds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(auto, "budget_s", lambda epoch_s: 0.0)  # the cold round spends it all
    fit(tmp_path / "auto", strategy="auto", max_steps=1)
    record = json.loads((tmp_path / "auto" / "config.json").read_text())["resolved"]["auto"]
    assert record["rounds"] == auto.MIN_ROUNDS and record["over_budget"]
    assert "3 timed rounds (past the budget" in capsys.readouterr().out


def raced(stdout: str) -> int:
    """How many race blocks ``stdout`` holds."""
    return sum(line.startswith("strategy auto: ") for line in stdout.splitlines())


def test_the_choice_is_recorded_and_a_resume_does_not_race(tmp_path):
    out = tmp_path / "run"
    args = ["train", "-a", "own_model:make_net", "--data", "own_model:pairs", "-b", "8",
            "--epochs", "2", "--no-progress", "--devices", "cpu:2", "--out", out]
    first = run_in_process(*args, "--strategy", "auto", "--auto-steps", "3", "--max-steps", "1")
    assert first.returncode == 0, first.stderr
    assert raced(first.stdout) == 1
    config = json.loads((out / "config.json").read_text())
    choice = config["resolved"]["auto"]["choice"]
    assert config["parallel"]["strategy"] == choice and config["resolved"]["auto"]["table"]
    again = run_in_process("train", "--resume", out, "--strategy", "auto", "--max-steps", "2")
    assert again.returncode == 0, again.stderr
    assert not raced(again.stdout)
    assert f"the run already has --strategy {choice} (chosen by its race)" in again.stdout
    plain = run_in_process("train", "--resume", out, "--max-steps", "3")
    assert plain.returncode == 0 and not raced(plain.stdout)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["config"]["resolved"]["auto"]["choice"] == choice  # kept through resumes


def test_bench_explain_prints_planned_bytes_next_to_the_measured_steps():
    result = run_in_process("bench", "-a", "cifar_resnet20", "--strategies", "single,dp",
                            "--devices", "cpu:2", "-b", "4", "--steps", "1", "--warmup", "0",
                            "--image-size", "8", "--baselines", "none", "--explain")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("plan vs clock:")[1].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line.strip()}
    assert set(rows) == {"single", "dp"}
    assert rows["single"][:2] == ["0", "0"] and rows["dp"][0] not in ("0", "n/a")


def test_the_reason_gives_the_planned_bytes_against_the_rival_or_dp():
    row = lambda n, m: {"name": n, "median_s": m, "q1_s": m, "q3_s": m}  # noqa: E731
    planned = {"single": 0, "dp": 1000, "balanced": 900, "hybrid": 930}
    rows = [row("single", 2.0), row("dp", 1.43), row("hybrid", 1.0)]
    assert auto.choose(rows, planned) == ("hybrid", "hybrid: 1.43x dp, 0.93x the bytes dp plans")
    rows = [row("single", 1.16), row("hybrid", 1.0)]
    assert auto.choose(rows, planned)[1] == "hybrid: 1.16x single, 0.93x the bytes dp plans"
    assert auto.choose([row("single", 1.0), row("dp", 1.5)], planned)[1] == "single: 1.50x dp"


def test_one_device_is_single_without_a_race(tmp_path):
    result = run_in_process("train", "-a", "own_model:make_net", "--data", "own_model:pairs",
                            "-b", "8", "--epochs", "1", "--max-steps", "1", "--no-progress",
                            "--strategy", "auto", "--devices", "cpu", "--out", tmp_path / "r")
    assert result.returncode == 0, result.stderr
    assert "no race: one candidate" in result.stdout
    assert "chosen: single: the only candidate" in result.stdout


@pytest.mark.cuda
def test_auto_races_on_cuda_and_records_its_choice(tmp_path):
    """The race's clock on a GPU (synchronised), two replicas on one device: it runs, the
    choice is one of the raced rows, and the run trains with it."""
    out = tmp_path / "run"
    result = run_in_process("train", "-a", "own_model:make_net", "--data", "own_model:pairs",
                            "-b", "8", "--epochs", "1", "--max-steps", "2", "--no-progress",
                            "--strategy", "auto", "--auto-steps", "3", "--devices", "cuda:0,0",
                            "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert raced(result.stdout) == 1
    config = json.loads((out / "config.json").read_text())
    auto_record = config["resolved"]["auto"]
    assert config["parallel"]["strategy"] == auto_record["choice"]
    assert auto_record["choice"] in {row["name"] for row in auto_record["table"]}, auto_record
    assert (out / "checkpoint.pt").exists()


def test_a_race_across_processes_calls_a_wider_gap_a_tie():
    """Across processes a step waits on the link, whose noise is larger: hybrid-ddp 6% faster
    than ddp, with quartiles apart, wins a one-process race's 3% rule but not the 10% of a race
    across processes, where the simpler (ddp) is kept; 15% faster wins both (the control)."""
    row = lambda n, m: {"name": n, "median_s": m, "q1_s": m * 0.99, "q3_s": m * 1.01}  # noqa: E731
    rows = [row("ddp", 1.0), row("hybrid-ddp", 0.94)]
    assert auto.choose(rows)[0] == "hybrid-ddp"
    assert auto.choose(rows, noise=auto.PROCESS_NOISE)[0] == "ddp"
    faster = [row("ddp", 1.0), row("hybrid-ddp", 0.85)]
    assert auto.choose(faster, noise=auto.PROCESS_NOISE)[0] == "hybrid-ddp"
