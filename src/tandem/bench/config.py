"""The benchmark's settings: one dataclass that checks itself and is written into the JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tandem.strategies.compile import COMPILE_MODES
from tandem.parallel.buffers import POLICIES
from tandem.parallel.devices import parse_device_spec
from tandem.errors import UsageError

__all__ = ["BASELINES", "BenchConfig", "parse_names", "default_strategies"]



def default_strategies() -> tuple[str, ...]:
    """Every single-process strategy that takes any model (multi-process ones need torchrun)."""
    from tandem.strategies import Strategy, strategy_class, strategy_names

    return tuple(n for n in strategy_names(multiprocess=False)
                 if strategy_class(n).check_model.__func__ is Strategy.check_model.__func__)


# Plain-torch baselines (see tandem.bench.baselines); torch_ddp also runs under torchrun.
BASELINES = ("bare", "torch_dp", "torch_ddp")


def parse_names(text, valid: tuple[str, ...], flag: str, allow_empty: bool = False
                ) -> tuple[str, ...]:
    """``"single,dp"`` (or a sequence) -> ``("single", "dp")``, checked against ``valid``.

    Unknown or repeated names are a ``ValueError`` naming ``flag``; ``"none"`` is ``()`` when
    ``allow_empty``.
    """
    if not isinstance(text, str):
        text = ",".join(text)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("none",):
        names = ()
    if not names and not allow_empty:
        raise UsageError(f"bad {flag} {text!r}: give at least one of {', '.join(valid)}")
    for name in names:
        if name not in valid:
            raise UsageError(f"unknown name {name!r} in {flag}; choose from {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise UsageError(f"bad {flag} {text!r}: a name is listed twice")
    return names


@dataclass
class BenchConfig:
    """What to race and how.

    ``batch_size`` is the global batch, split over each contestant's devices or processes.
    ``image_size``/``num_classes`` default to the model's own. ``threads`` is intra-op threads
    per replica (default: torch's choice here, divided by N in each of N torchrun workers).
    ``compile`` adds a ``<name>+compile`` twin of every contestant; its warm-up step compiles.
    """

    arch: str
    strategies: tuple[str, ...] | None = None  # None: default_strategies()
    devices: str = "auto"
    batch_size: int = 64
    steps: int = 20
    warmup: int = 3
    image_size: int | None = None
    num_classes: int | None = None
    amp: bool = False
    amp_dtype: str = "fp16"
    channels_last: bool = False
    sync_bn: bool = False
    buffers: str = "replica0"
    baselines: tuple[str, ...] = BASELINES
    lr: float = 0.01
    seed: int = 0
    dist_timeout: float = 900.0
    cudnn_benchmark: bool = True
    threads: int | None = None
    compile: bool = False
    compile_mode: str | None = None
    device_list: list[torch.device] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        from tandem.strategies import strategy_names

        if self.strategies is None:
            self.strategies = default_strategies()
        self.strategies = parse_names(self.strategies, tuple(strategy_names()), "--strategies")
        self.baselines = parse_names(self.baselines, BASELINES, "--baselines", allow_empty=True)
        from tandem.models import model_info

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
        if self.amp_dtype not in ("bf16", "fp16"):
            raise UsageError(f"bad amp dtype {self.amp_dtype!r}: choose bf16 or fp16")
        if self.buffers not in POLICIES:
            raise UsageError(f"bad buffers {self.buffers!r}: choose replica0 or average")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"bad threads {self.threads!r}: must be >= 1")
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise UsageError(f"bad compile mode {self.compile_mode!r}: choose one of "
                             f"{', '.join(COMPILE_MODES)}")
        if self.compile_mode is not None and not self.compile:
            raise UsageError("--compile-mode needs --compile")
        if self.compile and self.warmup < 1:
            raise UsageError("--compile needs --warmup >= 1 (the first step compiles)")
        if self.dist_timeout <= 0:
            raise UsageError(f"bad dist_timeout {self.dist_timeout!r}: must be > 0")
        self.device_list = parse_device_spec(self.devices, "--devices")

    def to_dict(self) -> dict:
        """JSON-ready settings, with the resolved devices."""
        data = asdict(self)
        data["strategies"] = list(self.strategies)
        data["baselines"] = list(self.baselines)
        data["device_list"] = [str(d) for d in self.device_list]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "BenchConfig":
        data = {k: v for k, v in data.items() if k != "device_list"}
        return cls(**data)
