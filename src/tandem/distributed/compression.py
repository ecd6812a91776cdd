"""``--grad-compression``: the data-parallel gradients sent in bf16 or fp16, or as PowerSGD's
low-rank factors (Vogels et al., 2019), through torch's DDP communication hooks.

Knowingly lossy: the update is no longer single's. :class:`Compressor`, the hook's state,
measures on a step it is asked to how far the compressed average lies from the exact one (an
extra exact all-reduce of that step's gradients), and carries PowerSGD's state (each rank's
error feedback, the warm-started factors, the generator that seeds them) into checkpoints.

PowerSGD keys its state by DDP's bucket; DDP lays its buckets out again after the first step,
and a resumed run starts from the first layout again. So the state is kept per layout and
handed over per parameter when a new layout takes a parameter an older one held. A matrix
product's rounding depends on where its data sits in memory, so until DDP lays a resumed run's
buckets out again, PowerSGD runs on copies laid out as the saved run's were: the resume is
bitwise the straight run.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState, _should_compress, powerSGD_hook)

from tandem.errors import UsageError, param
from tandem.parallel import traffic
from tandem.suggest import did_you_mean

MODES = ("none", "bf16", "fp16", "powersgd")
#: the least start torch allows with error feedback: DDP lays its buckets out again after step 1
POWERSGD_START = 2
POWERSGD_RANK = 1  # torch's default
_MIN_RATE = 2  # torch's min_compression_rate: a matrix is factored when that saves 2x at least
_HOOKS = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
          "fp16": default_hooks.fp16_compress_hook}


@dataclass(frozen=True)
class Compression:
    """A ``--grad-compression`` value: ``mode`` (:data:`MODES`) and PowerSGD's ``rank``."""

    mode: str = "none"
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "Compression":
        mode, colon, rank = str(text).partition(":")
        if mode not in MODES:
            raise UsageError(f"unknown {param('grad_compression')} {text!r}"
                             f"{did_you_mean(mode, list(MODES))}",
                             hint="choose none, bf16, fp16 or powersgd[:RANK]")
        if mode != "powersgd":
            if colon:
                raise UsageError(f"{param('grad_compression')} {mode} takes no rank ({text!r})")
            return cls(mode)
        if not colon:
            return cls(mode, POWERSGD_RANK)
        if not rank.isdigit() or int(rank) < 1:
            raise UsageError(f"bad {param('grad_compression')} {text!r}: the rank must be a "
                             f"whole number >= 1 (powersgd:2)")
        return cls(mode, int(rank))

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.mode == "powersgd" else self.mode

    @property
    def exact(self) -> bool:
        return self.mode == "none"

    def sent_bytes(self, tensors) -> float:
        """Bytes one rank hands the all-reduce for the gradients of ``tensors`` in a
        compressed step (a ring sends ``2 (W-1)/W`` of them): bf16/fp16 two a value; PowerSGD a
        matrix's factors ``(n + m) r`` where that saves 2x (torch's rule), the rest whole."""
        total = 0.0
        for p in tensors:
            if self.mode in ("bf16", "fp16"):
                total += 2 * p.numel()
            elif self.mode == "powersgd" and p.dim() > 0 and p.numel() > 0:
                n, m = p.shape[0], p.numel() // p.shape[0]
                small, _, factors = _should_compress(n, m, min(n, m, self.rank), _MIN_RATE)
                total += p.element_size() * (factors if small else p.numel())
            else:
                total += p.element_size() * p.numel()
        return total


NONE = Compression()


class _Keyed:
    """A DDP bucket whose ``index()`` is its layout's key, for PowerSGD's dicts."""

    def __init__(self, bucket, key: int):
        self._bucket, self._key = bucket, key

    def index(self) -> int:
        return self._key

    def __getattr__(self, name):
        return getattr(self._bucket, name)


class _Laid:
    """A bucket of its own ``buffer``, laid out as ``layout``, for PowerSGD."""

    def __init__(self, buffer: torch.Tensor, layout: tuple, key: int, last: bool):
        self._buffer, self._layout, self._key, self._last = buffer, layout, key, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[at:at + n].view(shape) for _, at, n, shape in self._layout]

    def index(self) -> int:
        return self._key

    def is_last(self) -> bool:
        return self._last


class Compressor:
    """The communication hook's state for one DDP model (:meth:`register`): ``compression`` over
    ``group`` (``None``: the world), the result times ``scale`` (1: DDP's mean; the group's size:
    a sum). After a step that :meth:`measure_next` also all-reduced exactly, :attr:`error` is
    ``|compressed - exact| / |exact|`` over all the gradients (the same on every rank)."""

    def __init__(self, compression: Compression, group=None, scale: float = 1.0):
        self.compression, self.group, self.scale = compression, group, scale
        self.powersgd = None
        if compression.mode == "powersgd":
            self.powersgd = PowerSGDState(
                group, matrix_approximation_rank=compression.rank, min_compression_rate=_MIN_RATE,
                start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True,
                random_seed=0, compression_stats_logging_frequency=2 ** 62)
        self._index: dict[int, int] = {}  # id(parameter) -> its place in the module
        self._layouts: dict[tuple, int] = {}  # a bucket layout -> its key in PowerSGD's dicts
        self._next_key = 0
        self._loose: dict[str, dict[int, torch.Tensor]] = {"error": {}, "q": {}}
        self._measuring = False
        self._sums: list[float] | None = None  # |compressed - exact|^2, |exact|^2 measured
        self._lock = threading.Lock()  # gloo completes buckets in threads of its own
        self._chain = None  # the last PowerSGD bucket's future, until the next bucket's hook
        self._sampled_epoch: int | None = None
        self.order: list[tuple] = []  # the last whole step's bucket layouts, in DDP's order
        self._seen: list[tuple] = []
        self._saved: list[tuple] | None = None  # a resumed run's layouts, until DDP's agree
        self._laid: dict = {}  # while laid out as saved: gradients here, layouts done, waiting

    def register(self, ddp) -> None:
        """Install the hook on ``ddp`` (a ``DistributedDataParallel``)."""
        self._index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        self.parameters = [p for p in ddp.module.parameters() if p.requires_grad]
        ddp.register_comm_hook(self, Compressor._hook)

    def due(self, position) -> bool:
        """Whether the step after ``position`` is sampled (the same on every rank): its epoch's
        first that compresses (PowerSGD sends its first steps exact) or the first after a resume."""
        exact_first = POWERSGD_START if self.powersgd is not None else 0
        if position.step < exact_first or self._sampled_epoch == position.epoch:
            return False
        self._sampled_epoch = position.epoch
        return True

    def measure_next(self) -> None:
        """Measure the next synchronised step's error (every rank at the same step)."""
        self._measuring, self._sums = True, [0.0, 0.0]

    def take_error(self) -> float | None:
        """:attr:`error`, then forgotten: each epoch says its own."""
        value, self._sums = self.error, None
        return value

    @property
    def error(self) -> float | None:
        """The measured step's relative error (``None``: none measured yet)."""
        if self._sums is None:
            return None
        wrong, norm = self._sums
        return math.sqrt(wrong / norm) if norm else 0.0

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    # -- the hook -----------------------------------------------------------------------------
    def _hook(self, bucket):  # no annotation: DDP refuses a string one
        if self._chain is not None:
            # PowerSGD issues its second and third all-reduce from a callback: one bucket's
            # must all be issued before the next bucket's first, or the ranks' order differs
            self._chain.wait()
            self._chain = None
        exact = None
        if self._measuring:
            exact = bucket.buffer().detach().clone()
            exact_done = dist.all_reduce(exact, group=self.group, async_op=True).get_future()
            self._measuring = not bucket.is_last()
        if traffic.metering():
            world = self.world
            late = self.powersgd is not None and self.powersgd.iter < POWERSGD_START
            sent = NONE if late else self.compression
            traffic.record("gradients", 2 * (world - 1) / world * sent.sent_bytes(
                bucket.gradients()))
        if self.compression.mode == "powersgd":
            done = self._powersgd(bucket)
        else:
            done = _HOOKS[self.compression.mode](self.group, bucket)
        sums = self._sums

        def finish(fut):
            out = fut.value()
            out = out[0] if isinstance(out, list) else out
            if exact is not None:
                exact_done.wait()
                reference = exact.div_(self.world).to(torch.float64)
                wrong = float((out.to(torch.float64) - reference).pow(2).sum())
                norm = float(reference.pow(2).sum())
                with self._lock:
                    sums[0], sums[1] = sums[0] + wrong, sums[1] + norm
            return out.mul_(self.scale) if self.scale != 1 else out

        chained = done.then(finish)
        if self.powersgd is not None and not bucket.is_last() and not self._laid:
            self._chain = chained  # (laid out as saved, each bucket's waits for later ones)
        return chained

    # -- PowerSGD's state per bucket layout ----------------------------------------------------
    def _powersgd(self, bucket) -> torch.futures.Future:
        layout = self._layout(bucket)
        self._seen.append(layout)
        if bucket.is_last():
            self.order, self._seen = self._seen, []
        if self._saved is not None and layout not in self._saved:
            return self._as_saved(bucket, layout)
        self._saved = None  # DDP lays the buckets out as the saved run did
        return powerSGD_hook(self.powersgd, _Keyed(bucket, self._key(layout)))

    def _as_saved(self, bucket, layout: tuple) -> torch.futures.Future:
        """PowerSGD on copies laid out as the saved run's buckets, each once its gradients
        are all here, in the saved order; ``bucket``'s future once its own are done."""
        laid = self._laid = self._laid or {"ready": {}, "done": set(), "waiting": [], "next": 0}
        buffer = bucket.buffer()
        for index, at, n, _ in layout:
            laid["ready"][index] = buffer[at:at + n]
        result = torch.futures.Future()
        laid["waiting"].append(({entry[0] for entry in layout}, buffer, result))
        saved = self._saved
        while laid["next"] < len(saved) and all(e[0] in laid["ready"] for e in saved[laid["next"]]):
            target = saved[laid["next"]]
            laid["next"] += 1
            copy = buffer.new_empty(sum(entry[2] for entry in target))
            for index, at, n, _ in target:
                copy[at:at + n] = laid["ready"][index]
            out = powerSGD_hook(self.powersgd, _Laid(copy, target, self._key(target),
                                                     laid["next"] == len(saved))).wait()
            out = out[0] if isinstance(out, list) else out
            for index, at, n, _ in target:
                laid["ready"].pop(index).copy_(out[at:at + n])
                laid["done"].add(index)
        for entry in list(laid["waiting"]):
            if entry[0] <= laid["done"]:
                laid["waiting"].remove(entry)
                entry[2].set_result(entry[1])
        if bucket.is_last():
            self._laid = {}
        return result

    def _layout(self, bucket) -> tuple:
        """``((parameter, offset, numel, shape), ...)`` of ``bucket``'s flat buffer."""
        base = bucket.buffer().storage_offset()
        return tuple((self._index[id(p)], g.storage_offset() - base, g.numel(), tuple(g.shape))
                     for p, g in zip(bucket.parameters(), bucket.gradients()))

    def _key(self, layout: tuple) -> int:
        key = self._layouts.get(layout)
        if key is None:
            mine = {entry[0] for entry in layout}
            for old, old_key in list(self._layouts.items()):
                if mine & {entry[0] for entry in old}:  # a parameter changes bucket: hand over
                    self._loosen(old, old_key)
                    del self._layouts[old]
            key = self._layouts[layout] = self._next_key
            self._next_key += 1
            self._install(layout, key)
        return key

    def _q_slices(self, layout: tuple) -> list[tuple[int, int, int]]:
        """``(parameter, offset, size)`` of each factored matrix's Q in the flat Q memory of a
        bucket with ``layout`` (grouped by shape, as torch packs them), then ``(-1, 0, P size)``."""
        groups: dict[tuple, list] = defaultdict(list)
        p_size = 0
        for index, _, numel, shape in layout:
            n = shape[0] if shape else 1
            m = numel // n if n else 0
            r = min(n, m, self.compression.rank)
            if numel and _should_compress(n, m, r, _MIN_RATE)[0]:
                groups[(n, m)].append((index, m * r))
                p_size += n * r
        slices, at = [], 0
        for members in groups.values():
            for index, size in members:
                slices.append((index, at, size))
                at += size
        return [*slices, (-1, 0, p_size)]

    def _loosen(self, layout: tuple, key: int) -> None:
        """Move the state of bucket layout ``layout`` (PowerSGD's ``key``) to per parameter."""
        s = self.powersgd
        error = s.error_dict.pop(key, None)
        if error is not None:
            for index, offset, numel, _ in layout:
                self._loose["error"][index] = error[offset:offset + numel].clone()
        q = s.q_memory_dict.pop(key, None)
        s.p_memory_dict.pop(key, None)
        if q is not None:
            for index, offset, size in self._q_slices(layout)[:-1]:
                self._loose["q"][index] = q[offset:offset + size].clone()

    def _install(self, layout: tuple, key: int) -> None:
        """Give bucket layout ``layout`` (``key``) the per-parameter state it holds."""
        s, loose = self.powersgd, self._loose
        held = [entry for entry in layout if entry[0] in loose["error"]]
        if held:
            error = loose["error"][held[0][0]].new_zeros(sum(entry[2] for entry in layout))
            for index, offset, numel, _ in held:
                error[offset:offset + numel] = loose["error"].pop(index)
            s.error_dict[key] = error
        *slices, (_, _, p_size) = self._q_slices(layout)
        if slices and all(index in loose["q"] for index, _, _ in slices):
            parts = [loose["q"].pop(index) for index, _, _ in slices]
            s.q_memory_dict[key] = torch.cat(parts)
            s.p_memory_dict[key] = parts[0].new_empty(p_size)

    # -- checkpoints ------------------------------------------------------------------------
    def rank_state(self) -> dict:
        """This rank's PowerSGD state, per parameter (layouts do not outlive a run)."""
        s = self.powersgd
        if s is None:
            return {}
        for layout, key in list(self._layouts.items()):
            self._loosen(layout, key)
        self._layouts.clear()
        loose = {kind: {i: t.detach().cpu().clone() for i, t in part.items()}
                 for kind, part in self._loose.items()}
        kind, keys, pos, has_gauss, cached = s.rng.get_state()  # what seeds each new Q
        rng = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
               "has_gauss": int(has_gauss), "cached": float(cached)}
        return {"iter": s.iter, "rng": rng, "layouts": list(self.order), **loose}

    def load_rank_state(self, state: dict, device: torch.device) -> None:
        """Continue from :meth:`rank_state`'s ``state`` (saved by this rank of a job as wide)."""
        s = self.powersgd
        if s is None or not state:
            return
        s.iter = int(state["iter"])
        r = state["rng"]
        s.rng.set_state((r["kind"], r["keys"].numpy().astype("uint32"), r["pos"], r["has_gauss"],
                         r["cached"]))
        s.error_dict.clear(), s.p_memory_dict.clear(), s.q_memory_dict.clear()
        self._layouts.clear()
        self._loose = {kind: {int(i): t.to(device) for i, t in state.get(kind, {}).items()}
                       for kind in ("error", "q")}
        layouts = [tuple(tuple(entry) for entry in layout) for layout in state.get("layouts", [])]
        held = {entry[0] for layout in layouts for entry in layout}
        mine = {self._index[id(p)] for p in self.parameters}
        self._saved = layouts if layouts and held == mine else None  # the same parameters

    def state(self, rank: int, alone: bool = False) -> dict | None:
        """Every rank's :meth:`rank_state` on rank 0 (a collective on every rank of the group;
        ``None`` elsewhere); ``alone``: rank 0's own, where a peer is lost."""
        if self.powersgd is None:
            return {"mode": str(self.compression)} if rank == 0 else None
        mine, gathered = self.rank_state(), None
        if not alone:
            gathered = [None] * self.world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=dist.get_global_rank(self.group, 0)
                               if self.group is not None else 0, group=self.group)
            if rank != 0:
                return None
        return {"mode": str(self.compression), "ranks": gathered, "iter": mine["iter"],
                "rng": mine["rng"]}

    def load(self, saved: dict | None, rank: int, device: torch.device) -> str | None:
        """Continue from :meth:`state`'s ``saved``; a line if PowerSGD starts afresh, else None."""
        if self.powersgd is None:
            return None
        if not isinstance(saved, dict) or saved.get("mode") != str(self.compression):
            return (f"{param('grad_compression')} {self.compression}: the checkpoint holds no "
                    f"PowerSGD state of it; its error feedback and factors start afresh")
        ranks = saved.get("ranks")
        if ranks is not None and len(ranks) == self.world:
            self.load_rank_state(ranks[rank], device)
            return None
        self.load_rank_state({"iter": saved["iter"], "rng": saved["rng"]}, device)
        why = ("saved when a peer was lost" if ranks is None else
               f"saved by {len(ranks)} processes, this run has {self.world}")
        return (f"{param('grad_compression')} {self.compression}: PowerSGD's error feedback "
                f"and factors start afresh ({why}); its step count and seeds continue")
