"""The benchmark's settings: one dataclass that checks itself and is written into the JSON."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field

import torch

from tandem.config import opt
from tandem.distributed.env import Environment, cpu_bf16_override
from tandem.errors import UsageError, param
from tandem.models import model_info
from tandem.parallel.buffers import POLICIES
from tandem.parallel.devices import parse_device_spec
from tandem.precision import AMP_DTYPES, amp_precision
from tandem.strategies import strategy_class, strategy_names
from tandem.strategies.compile import COMPILE_MODES

from .link import parse_rate
from .variants import VARIANTS


def default_strategies() -> tuple[str, ...]:
    """Every single-process strategy that takes any model (multi-process ones need torchrun)."""

    return tuple(n for n in strategy_names(multiprocess=False)
                 if strategy_class(n).takes_any_model())


# Plain-torch baselines (see tandem_bench.baselines); torch_ddp also runs under torchrun.
BASELINES = ("bare", "torch_dp", "torch_ddp")


def parse_names(text, valid: tuple[str, ...], name: str, allow_empty: bool = False
                ) -> tuple[str, ...]:
    """``"single,dp"`` (or a sequence) -> ``("single", "dp")``, checked against ``valid``.

    Unknown or repeated names are a ``ValueError`` naming parameter ``name``; ``"none"`` is
    ``()`` when ``allow_empty``.
    """
    what = param(name)
    if not isinstance(text, str):
        text = ",".join(text)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("none",):
        names = ()
    if not names and not allow_empty:
        raise UsageError(f"bad {what} {text!r}: give at least one of {', '.join(valid)}")
    for given in names:
        if given not in valid:
            raise UsageError(f"unknown name {given!r} in {what}; choose from {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise UsageError(f"bad {what} {text!r}: a name is listed twice")
    return names


def _strategies_help() -> str:
    """Asked when the parser is built: the registry's names and the default they give."""

    return (f"comma list of {', '.join(strategy_names())}; by default every single-process "
            f"strategy that takes any model (default: {','.join(default_strategies())})")


@dataclass
class BenchConfig:
    """What to race and how; each field carries its ``tandem bench`` flag (``tandem.config.opt``).

    ``batch_size`` is the global batch, split over each contestant's devices or processes.
    ``image_size``/``num_classes`` default to the model's own. ``threads`` is intra-op threads
    per replica (default: torch's choice here, divided by N in each of N torchrun workers).
    ``compile`` adds a ``<name>+compile`` twin of every contestant; its warm-up step compiles.
    ``variants`` races ``<name>+cl``, ``+amp`` and ``+amp+cl`` twins (:mod:`.variants`).
    ``loop`` adds a ``<name>/loop`` twin of every strategy contestant (:mod:`.loop`).
    """

    arch: str = opt(MISSING, "model name (see `tandem models`); required unless --data times "
                    "the input pipeline", "-a", "--arch", metavar="ARCH")
    strategies: tuple[str, ...] | None = opt(None, _strategies_help, metavar="LIST")
    devices: str = opt("auto", "cpu, cpu:N, cuda, cuda:0,1 or auto", metavar="SPEC")
    batch_size: int = opt(64, "global batch per step", "-b", "--batch-size", metavar="N")
    steps: int = opt(20, "timed steps per contestant (with --data: timed passes over the "
                     "files, 5 unless given)", metavar="N")
    warmup: int = opt(3, "untimed steps first (with --data: passes, 1 unless given)",
                      metavar="N")
    image_size: int | None = opt(None, "square input size (default: 32 for cifar_*, else 224)",
                                 metavar="PX")
    num_classes: int | None = opt(None, "classifier outputs (default: 10 for cifar_*, else "
                                  "1000)", metavar="K")
    amp: bool = opt(False, "autocast as `tandem train --amp`: bf16 on the CPU, fp16 + "
                    "GradScaler on CUDA (see --amp-dtype)")
    amp_dtype: str | None = opt(None, "bf16, or fp16 (adds a GradScaler; CUDA only); default: "
                                "the device's", choices=AMP_DTYPES)
    channels_last: bool = opt(False, "NHWC model and inputs")
    variants: tuple[str, ...] | None = opt(
        None, "race these twins of every contestant, interleaved: comma list of "
        "fp32,cl,amp,amp+cl (cl: channels-last; amp: as --amp); instead of --amp and "
        "--channels-last", metavar="LIST")
    sync_bn: bool = opt(False, "strategies use SyncBatchNorm")
    buffers: str = opt(POLICIES[0], "dp: which replicas' batch-norm running stats to keep",
                       choices=POLICIES)
    baselines: tuple[str, ...] = opt(BASELINES, "plain-torch contestants to add, or 'none'",
                                     metavar="LIST")
    lr: float = opt(0.01, "SGD learning rate of every contestant", metavar="LR")
    seed: int = opt(0, "seed for model and data", metavar="S")
    dist_timeout: float = opt(900.0, "seconds allowed for the torchrun phase (the "
                              "multi-process strategies and torch_ddp)", metavar="SECONDS")
    cudnn_benchmark: bool = opt(True, "leave cuDNN's autotuner off (CUDA)",
                                "--no-cudnn-benchmark")
    threads: int | None = opt(None, "intra-op threads per replica (thread here, or torchrun "
                              "worker); default: torch's choice, split among workers",
                              metavar="N")
    compile: bool = opt(False, "also race a compiled twin (<name>+compile) of every contestant")
    compile_mode: str | None = opt(None, "torch.compile mode (with --compile; default: torch's)",
                                   choices=COMPILE_MODES)
    loop: bool = opt(False, "also race a twin (<name>/loop) of every strategy contestant that "
                     "times one whole `tandem train` loop step (on device batches, no loader)")
    print_freq: int = opt(0, "with --loop: the loop twins' --print-freq (their lines go to "
                          "stderr; 0: never)", "-p", "--print-freq", metavar="N")
    handicap: str | None = opt(None, "I:F: replica or rank I takes F times as long per sample "
                               "(extra passes over its own chunk, not a sleep); each "
                               "strategy that splits the batch then races with an equal "
                               "split, --split auto and the ideal split", metavar="I:F")
    link_rate: str | None = opt(None, "a link rate for the link plan's communication time a "
                                "step (--explain, and the JSON's link block), e.g. 100mbit, "
                                "1gbit or 12.5MB/s; a torchrun phase measures its own too",
                                metavar="RATE")
    link_processes: int | None = opt(None, "processes the link plan counts (default: one per "
                                     "device, as the torchrun phase runs them)", metavar="N")
    device_list: list[torch.device] = field(init=False, repr=False, compare=False)

    def __post_init__(self):

        if self.strategies is None:
            self.strategies = default_strategies()
        self.strategies = parse_names(self.strategies, tuple(strategy_names()), "strategies")
        self.baselines = parse_names(self.baselines, BASELINES, "baselines", allow_empty=True)

        info = model_info(self.arch)  # an unknown arch is a ValueError listing valid ones
        if self.image_size is None:
            self.image_size = info.native_input_size
        if self.num_classes is None:
            self.num_classes = info.default_num_classes
        for name in ("batch_size", "steps", "image_size", "num_classes"):
            if getattr(self, name) < 1:
                raise UsageError(f"bad {name} {getattr(self, name)!r}: must be >= 1")
        if self.warmup < 0:
            raise UsageError(f"bad warmup {self.warmup!r}: must be >= 0")
        if self.amp_dtype is not None and self.amp_dtype not in AMP_DTYPES:
            raise UsageError(f"bad amp dtype {self.amp_dtype!r}: choose bf16 or fp16")
        if self.variants is not None:

            self.variants = parse_names(self.variants, VARIANTS, "variants")
            if self.amp or self.channels_last:
                raise UsageError(f"{param('variants')} names each twin's precision and layout; "
                                 f"leave out {param('amp')} and {param('channels_last')}")
        if self.buffers not in POLICIES:
            raise UsageError(f"bad buffers {self.buffers!r}: choose replica0 or average")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"bad threads {self.threads!r}: must be >= 1")
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise UsageError(f"bad compile mode {self.compile_mode!r}: choose one of "
                             f"{', '.join(COMPILE_MODES)}")
        if self.compile_mode is not None and not self.compile:
            raise UsageError(f"{param('compile_mode')} needs {param('compile')}")
        if self.compile and self.warmup < 1:
            raise UsageError(f"{param('compile')} needs {param('warmup')} >= 1 (the first step "
                             "compiles)")
        if self.print_freq < 0:
            raise UsageError(f"bad print_freq {self.print_freq!r}: must be >= 0")
        if self.print_freq and not self.loop:
            raise UsageError(f"{param('print_freq')} is the loop twins' (it needs {param('loop')})")
        if self.dist_timeout <= 0:
            raise UsageError(f"bad dist_timeout {self.dist_timeout!r}: must be > 0")
        self.device_list = parse_device_spec(self.devices, "devices")
        if self.amp or any("amp" in v for v in self.variants or ()):  # one line where it can't
            amp_precision(self.device_list[0].type, True, self.amp_dtype,
                          cpu_bf16=cpu_bf16_override(Environment.read()))
        self.handicap_spec()  # a bad --handicap is refused here
        self.link_bytes_per_s()  # and a bad --link-rate
        if self.link_processes is not None and self.link_processes < 1:
            raise UsageError(f"bad {param('link_processes')} {self.link_processes!r}: must be "
                             ">= 1")

    def handicap_spec(self) -> tuple[int, float] | None:
        """``--handicap I:F`` as ``(I, F)``, checked against the devices; ``None`` without."""
        if self.handicap is None:
            return None
        try:
            index, factor = self.handicap.split(":")
            index, factor = int(index), float(factor)
        except ValueError:
            raise UsageError(f"bad {param('handicap')} {self.handicap!r}: give I:F, e.g. "
                             "1:2") from None
        if not 0 <= index < len(self.device_list):
            raise UsageError(f"bad {param('handicap')} {self.handicap}: index {index} is not one "
                             f"of the {len(self.device_list)} device(s)")
        if not factor >= 1:
            raise UsageError(f"bad {param('handicap')} {self.handicap}: F must be >= 1")
        return index, factor

    def link_bytes_per_s(self) -> float | None:
        """``--link-rate`` in bytes per second (:func:`.link.parse_rate`); ``None`` without."""
        return None if self.link_rate is None else parse_rate(self.link_rate, "link_rate")

    def processes(self) -> int:
        """The processes the link plan counts: ``--link-processes``, else one per device."""
        return self.link_processes or len(self.device_list)

    def ideal_split(self) -> tuple[float, ...] | None:
        """The shares that even out ``--handicap``'s speeds (1 / F for the slow one)."""
        spec = self.handicap_spec()
        if spec is None:
            return None
        return tuple(1 / spec[1] if i == spec[0] else 1.0 for i in range(len(self.device_list)))

    def to_dict(self) -> dict:
        """JSON-ready settings, with the resolved devices."""
        data = asdict(self)
        data["strategies"] = list(self.strategies)
        data["baselines"] = list(self.baselines)
        if self.variants is not None:
            data["variants"] = list(self.variants)
        data["device_list"] = [str(d) for d in self.device_list]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "BenchConfig":
        data = {k: v for k, v in data.items() if k != "device_list"}
        return cls(**data)
