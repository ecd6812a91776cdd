"""Single-GPU training throughput of ResNet-50 at 224 px with AMP and channels_last.

tandem's ``single`` strategy and a bare eager torch step (model, cross-entropy, SGD; no tandem)
are built from the same weights, fed the same synthetic batch, warmed up, and then timed
interleaved round by round with CUDA synchronised before each clock read (the harness of
``tandem bench``). The reference is NVIDIA DeepLearningExamples' ResNet-50 v1.5 PyTorch
training figure on one A100 with AMP (about 2,470 img/s); it is printed next to our numbers
for orientation only: a different GPU, data pipeline or software stack changes it.

On an H100 (the lead's run)::

    python benchmarks/gpu_resnet50.py --json runs/bench/gpu_resnet50.json

Smoke test on a CPU (what the test suite runs)::

    python benchmarks/gpu_resnet50.py --device cpu --arch cifar_resnet20 --image-size 32 \\
        --batch-size 4 --steps 2 --warmup 1

fp16 autocast with a GradScaler is the default, as in ``tandem train --amp`` and in NVIDIA's
AMP figure; ``--amp-dtype bf16`` needs no scaler. ``--no-amp`` and ``--no-channels-last`` give
fp32 / NCHW for comparison. cuDNN autotuning (``cudnn.benchmark``) is on for both contestants.
"""

from __future__ import annotations

import argparse
import sys

from tandem_bench import BenchConfig, format_table, run_bench, write_json

REFERENCE = {
    "source": ("NVIDIA DeepLearningExamples PyTorch ResNet-50 v1.5 README, training "
               "throughput, DGX A100 1x A100 80GB, mixed precision, pytorch-21.03 NGC container"),
    "images_per_sec": 2470,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--device", default="cuda:0", help="a single device, e.g. cuda:0 or cpu")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="timed steps per contestant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--amp-dtype", choices=["bf16", "fp16"], default=None,
                   help="fp16 (with a GradScaler) or bf16; default: as `tandem train --amp` "
                        "on the device (fp16 on CUDA, bf16 on the CPU)")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the full report ('-' for stdout)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "," in args.device or args.device.startswith("cpu:"):
        raise SystemExit(f"gpu_resnet50.py: --device {args.device!r}: give one device")
    config = BenchConfig(
        arch=args.arch, strategies=("single",), baselines=("bare",), devices=args.device,
        batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
        image_size=args.image_size, amp=not args.no_amp, amp_dtype=args.amp_dtype,
        channels_last=not args.no_channels_last)
    report = run_bench(config)
    report["reference"] = REFERENCE
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_table(report), file=out)
    by_name = {r["name"]: r for r in report["results"]}
    for name in ("single", "bare"):
        r = by_name[name]
        if r["status"] != "ok":
            print(f"{name}: {r['status']}: {r['reason']}", file=out)
    if all(by_name[n]["status"] == "ok" for n in ("single", "bare")):
        ours = by_name["single"]["images_per_sec"]["median"]
        bare = by_name["bare"]["images_per_sec"]["median"]
        print(f"tandem single {ours:.1f} img/s, bare eager torch {bare:.1f} img/s "
              f"(tandem/bare {ours / bare:.3f}); reference {REFERENCE['images_per_sec']} img/s "
              f"({REFERENCE['source']})", file=out)
    if config.device_list[0].type == "cpu":
        print("note: a CPU run is a smoke test of the script, not a GPU figure", file=out)
    if args.json:
        write_json(report, args.json)
    return 1 if any(r["status"] == "failed" for r in report["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
