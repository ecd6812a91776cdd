"""Regenerate the shown outputs of README.md and the docs pages from real runs:
``python scripts/readme_outputs.py``.

Each output block of README.md or a page under docs/ sits under a marker line
``<!-- readme_outputs: NAME -->``; this script runs NAME's commands (below, in order: later
blocks continue the runs of earlier ones) in a scratch directory, as a user would from the
repository root, and writes each command (``$ ...``) and its stdout and stderr into the block
(a block may be shown on more than one page: each copy gets the same output). The marker
``<!-- readme_outputs: machine -->`` is followed by one line naming the machine and torch.
``--check`` only lists the blocks and their commands. Its runs train for about a minute on a
quiet 2-core machine; shared with other jobs (load 6) the demo alone took almost 10 minutes.
The files are written once, at the end: a run stopped part-way changes nothing. A block inside
a list item keeps its fence's indentation. :func:`shape` is a block's lines with every number
masked: tests/integration/cli/test_readme.py runs the quick blocks and compares their shapes with
the pages'.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def pages() -> list[Path]:
    """README.md and the docs pages that may hold output blocks (generated pages aside)."""
    docs = REPO / "docs"
    return [README, *sorted(p for p in docs.rglob("*.md")
                            if "_generated" not in p.parts and "_build" not in p.parts
                            and p != docs / "README.md")]
MARK = re.compile(r"^<!-- readme_outputs: ([\w-]+) -->$")

# Hidden set-up steps start with "#": run, not shown.
FLOWERS = ("#python -c 'import numpy as np; from pathlib import Path; from PIL import Image; "
           "rng = np.random.default_rng(0); "
           "[(Path(\"flowers\", n).mkdir(parents=True, exist_ok=True), "
           "[Image.fromarray((rng.random((64, 64, 3)) * 60 + c * 90).astype(np.uint8))"
           ".save(Path(\"flowers\", n, f\"{i}.jpg\"), quality=90) for i in range(10)]) "
           "for c, n in enumerate((\"daisy\", \"rose\", \"tulip\"))]'")
EXAMPLE_FILE = ("#python -c 'import torch; from tandem.models import create_model; "
                "torch.manual_seed(0); "
                "model = torch.nn.DataParallel(create_model(\"resnet18\")); "
                "optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, "
                "weight_decay=1e-4); "
                "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1); "
                "torch.save({\"epoch\": 1, \"arch\": \"resnet18\", \"state_dict\": model.state_dict(), "
                "\"best_acc1\": torch.tensor(37.5), \"optimizer\": optimizer.state_dict(), "
                "\"scheduler\": scheduler.state_dict()}, \"checkpoint.pth.tar\")'")
OWN = "-a examples.own_classifier:SmallCNN --data examples.own_classifier:digits"

BLOCKS: dict[str, list[str]] = {
    "demo": ["make demo"],
    "demo-eval": ["tandem eval --resume runs/demo/best.pt"],
    "own-classifier": ["python examples/own_classifier.py"],
    "own-cli": [
        f"tandem train {OWN} --strategy dp --devices cpu:2 --sync-bn --lr 0.02 --epochs 3 "
        "--no-progress --out runs/own_cli",
        "tandem eval --resume runs/own_cli",
        "tandem train --resume runs/own_cli --epochs 4",
        "tandem train -a examples.own_classifier:SmallCnn --data digits",
        "tandem train -a examples.own_classifier:digits --data digits"],
    "models": ["tandem models"],
    "demo-resume": [
        "#cp -r runs/demo runs/copy",
        "tandem train --data digits --out runs/demo",
        "tandem train --resume runs/demo -b 64",
        "tandem train --resume runs/demo",
        "tandem train --resume runs/demo --epochs 5",
        "tandem train --resume runs/demo/best.pt --epochs 10",
        "tandem train --resume runs/demo --epochs 10 --max-steps 10",
        "tandem train --resume runs/demo --epochs 10"],
    "copy-single": ["tandem train --resume runs/copy --strategy single --epochs 9 "
                    "--max-steps 361"],
    "dist-url": [FLOWERS,
                 "tandem train -a resnet18 --dist-url tcp://10.0.0.1:23456 --dist-backend nccl "
                 "--multiprocessing-distributed --world-size 1 --rank 0 flowers"],
    "example-round-trip": [
        EXAMPLE_FILE,
        "tandem eval --resume checkpoint.pth.tar --data flowers",
        "tandem train -a resnet18 -b 8 --lr 0.1 --epochs 3 --resume checkpoint.pth.tar "
        "flowers --out runs/ex",
        "tandem train -e --resume runs/ex/best.pt flowers",
        "tandem eval --resume runs/ex/best.pt"],
    "short": ["tandem train --data digits --epochs 1 --max-steps 20 --out runs/short",
              "tandem train --resume runs/short"],
    "hot": ["tandem train --data digits --epochs 2 --lr 30 -p 10 --save-every 10 --out runs/hot; "
            "echo \"(exit status $?)\""],
    "typo": ["tandem train -a resnt50"],
    "fresh": ["tandem train -b 8 --epochs 2 flowers --out runs/fresh"],
    # after every block that uses runs/demo: --overwrite starts it afresh
    "auto-race": ["tandem train --arch cifar_resnet20 --data digits --strategy auto --devices "
                  "cpu:2 --epochs 8 --out runs/demo --overwrite --max-steps 1 --no-progress"],
    "pretrained": [
        "#python -c 'import torch; from tandem.models import create_model; "
        "torch.save(create_model(\"resnet18\").state_dict(), \"resnet18.pth\")'",
        "tandem train -a resnet18 --pretrained resnet18.pth flowers -b 8 --epochs 2 -p 2 "
        "--out runs/ft"],
    "bare-eval": ["tandem eval --resume resnet18.pth --data flowers",
                  "tandem eval --resume resnet18.pth -a resnet18 --data flowers"],
    "bench": ["tandem bench -a cifar_resnet20 --strategies single,dp,balanced --devices cpu:2 "
              "-b 32 --steps 5 --warmup 2 --image-size 16"],
}


def cpu_words() -> str:
    """The CPU as precisely as the kernels care: ``/proc/cpuinfo``'s model name (a virtual
    machine's may be as short as "AMD EPYC"), the instruction set torch's CPU kernels were
    chosen for here (``torch.backends.cpu.get_cpu_capability()``: AVX2, AVX512, ...) and the
    flags that change oneDNN's kernels (bf16, AMX). Two machines sold under one name but with
    other kernels round the same sums differently, so a block's losses differ between them."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == (platform.processor() or "unknown CPU"):
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    capability = subprocess.run([str(REPO / ".venv/bin/python"), "-c",
                                 "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                                capture_output=True, text=True).stdout.strip() or "unknown"
    extras = [("avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"),
              ("AMX" if {"amx_tile", "amx_bf16"} & flags else "no AMX")]
    return f"{model} (torch's {capability} kernels; {', '.join(extras)})"


def machine() -> str:
    """One line: the CPU (:func:`cpu_words`) and count, the OS, the load where other jobs
    shared the cores, and torch, as the outputs were made, and which of their figures depend
    on the machine."""
    torch = subprocess.run([str(REPO / ".venv/bin/python"), "-c",
                            "import torch; print(torch.__version__)"],
                           capture_output=True, text=True).stdout.strip()
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    shared = (f", shared with other jobs (load average {load:.1f} as it began: the times show "
              f"it)" if load > cores / 2 else "")
    return (f"The outputs shown on this page were made by `python scripts/readme_outputs.py` "
            f"on a {cores}-core {cpu_words()}, {platform.system()} "
            f"{platform.machine()}{shared}, torch {torch}, Python {platform.python_version()}, "
            f"on {time.strftime('%Y-%m-%d', time.gmtime())}. Machine-dependent: every time and "
            f"rate (s, ms, img/s), a race's choice, and the losses and accuracies, which "
            f"another CPU's kernels round otherwise (see \"The same update as one device\" in "
            f"the docs); the lines' words, sizes, counts and commands are not.")


def run_block(commands: list[str], cwd: Path, env: dict) -> list[str]:
    """Each shown command as ``$ command`` and its output (stdout and stderr, in order)."""
    shown = []
    for command in commands:
        hidden = command.startswith("#")
        command = command.lstrip("#")
        result = subprocess.run(command, shell=True, cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        if hidden:
            if result.returncode:
                raise SystemExit(f"set-up step failed: {command}\n{result.stdout}")
            continue
        shown.append(f"$ {command}")
        shown += result.stdout.rstrip("\n").splitlines()
    return shown


def scratch(root: Path) -> dict:
    """The scratch directory as the repository root looks to a user; the environment."""
    for name in ("examples", "Makefile", "pyproject.toml", ".venv"):
        (root / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PATH"] = f"{REPO / '.venv/bin'}{os.pathsep}{env['PATH']}"
    env.pop("VIRTUAL_ENV", None)
    return env


def shape(lines: list[str]) -> list[str]:
    """``lines`` with every number (``12``, ``0.5``, ``-3e-05``, ``nan``) and which of loss
    and weights overflowed first as ``#``: what a block must keep when the numbers of another
    machine or run differ."""
    number = r"\d+(\.\d+)?(e-?\d+)?|\b(nan|inf)\b"  # a loss may overflow to nan or inf
    # which of the loss and the weights overflows first is a matter of the numbers too
    first = r"\b(the weights|train loss) became non-finite"
    return [re.sub(number, "#", re.sub(first, "# became non-finite", line)) for line in lines]


def shown(text: str) -> dict[str, list[str]]:
    """Each marked block's lines in ``text`` (a page), its fence's indentation removed."""
    lines, blocks = text.splitlines(), {}
    for i, line in enumerate(lines):
        m = MARK.match(line.strip())
        if m and m.group(1) != "machine":
            indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            blocks[m.group(1)] = [x[indent:] for x in lines[i + 2:end]]
    return blocks


def markers(text: str) -> list[str]:
    return [m.group(1) for m in map(MARK.match, (x.strip() for x in text.splitlines())) if m]


def filled(text: str, outputs: dict[str, list[str]]) -> str:
    """``text`` with every marked block (and the machine line) replaced by ``outputs``."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = MARK.match(lines[i].strip())
        if m and m.group(1) == "machine":
            out.append(outputs["machine"][0])
            i += 2  # the old machine line
            continue
        if m:
            fence = lines[i + 1]
            indent = fence[:len(fence) - len(fence.lstrip())]  # a list item's block
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            out += [fence, *(indent + x if x else x for x in outputs[m.group(1)])]
            i = end
            continue
        i += 1
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    texts = {page: page.read_text() for page in pages()}
    names = {name for text in texts.values() for name in markers(text)}
    missing = sorted(n for n in names if n not in BLOCKS and n != "machine")
    unused = [n for n in BLOCKS if n not in names]
    if missing or unused:
        raise SystemExit(f"output markers without commands: {missing}; "
                         f"commands without a marker: {unused}")
    if "--check" in argv:
        for name, commands in BLOCKS.items():
            print(name, *commands, sep="\n  ")
        return 0
    outputs = {"machine": [machine()]}
    with tempfile.TemporaryDirectory(prefix="readme_outputs.") as tmp:
        root = Path(tmp)
        env = scratch(root)
        for name, commands in BLOCKS.items():  # in this order: later blocks use earlier runs
            start = time.monotonic()
            outputs[name] = run_block(commands, root, env)
            print(f"{name}: {time.monotonic() - start:.0f}s", file=sys.stderr)
    for page, text in texts.items():
        if markers(text):
            page.write_text(filled(text, outputs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
