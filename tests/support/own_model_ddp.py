"""One 2-process `tandem launch` of tests/support/own_model.py's factories, shared by the tests that
read it (a torchrun launch costs seconds of start-up):
tests/integration/torchrun/test_float32_accuracy.py compares its weights,
tests/integration/cli/test_factories.py checks that every rank imported the factories again."""

from conftest import SUPPORT, run_tandem

ARGS = ["train", "-a", "own_model:smooth_net", "--data", "own_model:pairs", "-b", "6",
        "--lr", "0.05", "--epochs", "1", "--max-steps", "3", "--seed", "2", "--no-progress"]
_runs = {}


def ddp_run(tmp_path_factory):
    """(the launch's CompletedProcess, its run directory): ``ARGS`` under ddp --sync-bn on 2
    gloo processes, launched once per session. The factories are found only because the
    working directory goes on each rank's sys.path (no PYTHONPATH is set)."""
    if "ddp" not in _runs:
        out = tmp_path_factory.mktemp("own_model_ddp") / "run"
        _runs["ddp"] = run_tandem("launch", "--nproc-per-node", "2", "--", *ARGS,
                                  "--strategy", "ddp", "--devices", "cpu", "--sync-bn",
                                  "--out", out, cwd=SUPPORT, timeout=240,  # own_model.py
                                  PYTHONWARNINGS="ignore"), out
    return _runs["ddp"]
