"""The ``parallel`` section of the training configuration: how a run uses its devices.

What changes how a step runs (strategy, devices, compile, shares) may change on resume; what
changes what it computes (amp, dtype, sync_bn, buffers) may not.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config_fields import MAY_CHANGE, check, check_choice, opt
from tandem.errors import UsageError, param
from tandem.parallel.buffers import POLICIES
from tandem.parallel.split import parse_split
from tandem.precision import AMP_DTYPES
from tandem.strategies import strategy_names
from tandem.strategies.auto import AUTO
from tandem.strategies.compile import COMPILE_MODES, compiling_strategies
from tandem.distributed.compression import Compression
from tandem.suggest import did_you_mean

DTYPES = ("float32", "float64")


def _strategy_names() -> tuple[str, ...]:
    """The registered strategies and ``auto``."""
    return (*strategy_names(), AUTO)


# The default strategy: the one-device reference every other one must match.
_REFERENCE = strategy_names(reference=True)[0]


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = opt(_REFERENCE, "how to use the devices (auto: race the ones that can "
                        "drive this model here, keep the fastest)", choices=_strategy_names,
                        on_resume=MAY_CHANGE)
    auto_steps: int | None = opt(None, "with --strategy auto: timed rounds of the race, 3 at least "
                                 "(default: after one cold round, as many as fit 5 s or 5%% of "
                                 "an epoch, at most 30 s, but 3 however long they take; under "
                                 "tandem launch 5, however long)",
                                 metavar="N", on_resume=MAY_CHANGE)
    devices: str = opt("auto", "cpu, cpu:N (N CPU replicas), cuda, cuda:0,1 or auto",
                       metavar="SPEC", on_resume=MAY_CHANGE, per_node=True)
    sync_bn: bool = opt(False, "batch norm over the whole global batch (SyncBatchNorm)")
    buffers: str = opt("replica0", "dp: which replicas' batch-norm running stats to keep",
                       choices=POLICIES)
    amp: bool = opt(False, "mixed precision: bf16 autocast on a CPU with bf16 instructions; "
                    "on CUDA fp16 autocast + grad scaling (see --amp-dtype). Weights and "
                    "checkpoints stay float32")
    amp_dtype: str | None = opt(None, "with --amp: bf16 or fp16 (default: the device's, bf16 "
                                "on the CPU, fp16 + grad scaling on CUDA)", choices=AMP_DTYPES)
    dtype: str = opt("float32", "weights and activations: float64 is for checking exactness, "
                     "where every strategy matches single to about 1e-12 instead of float32's "
                     "rounding (several times slower)", choices=DTYPES)
    channels_last: bool = opt(False, "channels-last (NHWC) memory format for the model and "
                              "its inputs", on_resume=MAY_CHANGE)
    compile: bool = opt(False, f"compile the model with torch.compile (with "
                        f"{' or '.join(compiling_strategies())}); the compile time is reported "
                        f"apart from step times", on_resume=MAY_CHANGE)
    compile_mode: str | None = opt(None, "torch.compile mode (with --compile; default: torch's)",
                                   choices=COMPILE_MODES, on_resume=MAY_CHANGE)
    split: str | None = opt(None, f"with {', '.join(strategy_names(splits_batch=True))}: each "
                            "device's (or rank's) share of every batch, as weights (3,1: three "
                            "quarters to the first) or auto (follow the measured speeds); the "
                            "update is the same (default: even shares)", metavar="W,W|auto",
                            on_resume=MAY_CHANGE)
    max_share: int | None = opt(None, "the most samples any one device (or rank) may take of a "
                                "batch; a batch or --split that needs more is refused at once",
                                metavar="N", on_resume=MAY_CHANGE)
    grad_compression: str = opt("none", f"with {', '.join(strategy_names(compresses_gradients=True))}: "
                                "send the data-parallel gradients in bf16 or fp16, or as "
                                "PowerSGD's rank-RANK factors (default 1) with error feedback, "
                                "from step 3. Lossy: the update is no longer single's (each "
                                "epoch's line says by how much)",
                                metavar="none|bf16|fp16|powersgd[:RANK]", on_resume=MAY_CHANGE)
    backward_threads: str | None = opt(None, "strategies with replica threads: on runs each CPU "
                                       "replica's backward in its own thread, off all in "
                                       "autograd's one (default: on when the replicas' threads "
                                       "add cores or with --split; decided when the run starts, "
                                       "kept in config.json and on resume)",
                                       choices=("on", "off"), on_resume=MAY_CHANGE)

    def __post_init__(self):
        check(bool(self.strategy), f"{param('strategy')} must not be empty")
        names = _strategy_names()
        if self.strategy not in names:
            raise UsageError(f"unknown {param('strategy')} {self.strategy!r}"
                             f"{did_you_mean(self.strategy, list(names))}",
                             hint=f"choose one of {', '.join(names[:-1])} or {names[-1]}")
        if self.backward_threads is not None:
            check_choice(self.backward_threads, ("on", "off"), "backward_threads")
        check_choice(self.buffers, POLICIES, "buffers")
        check_choice(self.dtype, DTYPES, "dtype")
        check(not (self.amp and self.dtype != "float32"),
               f"{param('amp')} mixes bf16/fp16 into float32 work; it cannot run with "
               f"{param('dtype')} {self.dtype}")
        if self.amp_dtype is not None:
            check_choice(self.amp_dtype, AMP_DTYPES, "amp_dtype")
            check(self.amp, f"{param('amp_dtype')} {self.amp_dtype} needs {param('amp')}")
        if self.split is not None:
            parse_split(self.split)
        Compression.parse(self.grad_compression)
        check(self.auto_steps is None or self.auto_steps >= 1,
              f"bad {param('auto_steps')} {self.auto_steps}: must be >= 1")
        check(self.max_share is None or self.max_share >= 1,
               f"bad {param('max_share')} {self.max_share}: must be >= 1")
        if self.compile_mode is not None:
            check_choice(self.compile_mode, COMPILE_MODES, "compile_mode")
            check(self.compile, f"{param('compile_mode')} {self.compile_mode} needs "
                                f"{param('compile')}")
