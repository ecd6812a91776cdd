import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- shared helpers for tests that run the `tandem` command --------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
              "TANDEM_INJECT_FAULT", "TANDEM_LAUNCH_ID")


def cli_env(**extra) -> dict:
    """The environment for a `tandem` subprocess: one intra-op thread, no torchrun leftovers."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TANDEM_DIST_TIMEOUT="60")
    env.update(extra)
    return env


def run_tandem(*argv, timeout=300, cwd=None, **env) -> subprocess.CompletedProcess:
    """Run `python -m tandem ARGV` to completion (text output captured, hard timeout)."""
    return subprocess.run([sys.executable, "-m", "tandem", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, env=cli_env(**env), cwd=cwd)


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
