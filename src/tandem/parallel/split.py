"""Batch shares by weight: how many samples of a batch each device (or rank) takes.

Every wrapper computes the whole-batch loss, so the shares change a step's time, not its update.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import torch

from tandem.errors import UsageError, param

from .auto_split import AutoSplit
from .shares import capped, format_shares, shares
from .work_clock import Span, seconds_of

AUTO = "auto"


def clock_from_spec(spec: str | None) -> "Callable[[int, int, float], float] | None":
    """A test clock ``(device, samples, seconds) -> seconds`` from ``spec`` (``"2,1"``: seconds
    per sample per device; ``"1,1~0.4"``: times a seeded factor in [0.6, 1.4]); ``None``: real."""
    if not spec:
        return None
    fake, _, spread = spec.partition("~")
    per_sample = [float(v) for v in fake.split(",")]
    noise: dict[int, random.Random] = {}  # each device's seeded draws of the noisy clock

    def clock(index: int, samples: int, seconds: float) -> float:
        factor = 1.0
        if spread:
            draw = noise.setdefault(index, random.Random(index))
            factor = 1.0 + float(spread) * (2.0 * draw.random() - 1.0)
        return samples * per_sample[index % len(per_sample)] * factor
    return clock


def parse_split(text: str, name: str = "split") -> tuple[float, ...] | str:
    """``"3,1"`` -> ``(3.0, 1.0)``; ``"auto"`` -> ``"auto"``; anything else a one-line error."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise UsageError(f"bad {param(name)} {text!r}",
                         hint="give weights like 3,1 (one per device) or auto") from None
    return check_weights(weights, None, name)


def check_weights(weights: Sequence[float], devices: int | None, name: str = "split"
                  ) -> tuple[float, ...]:
    """``weights`` as floats: one finite weight >= 0 per device (``None``: any count), not all 0."""
    name = param(name)
    weights = tuple(float(w) for w in weights)
    shown = format_shares(weights)
    if devices is not None and len(weights) != devices:
        raise UsageError(f"bad {name} {shown}: {len(weights)} weight(s) for {devices} device(s)",
                         hint="give one weight per device")
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights):
        raise UsageError(f"bad {name} {shown}: weights must be finite and >= 0")
    if not any(weights):
        raise UsageError(f"bad {name} {shown}: at least one weight must be above 0")
    return weights


def check_max_share(batch: int, weights: Sequence[float] | str, devices: int,
                    max_share: int | None, what: str = param("batch_size")) -> None:
    """Refuse a batch whose shares give a device more than ``max_share`` samples (``"auto"``
    weights: the batch must fit the caps at all)."""
    if max_share is None:
        return
    if batch > max_share * devices:
        raise UsageError(f"{what} {batch} does not fit {param('max_share')} {max_share} on "
                         f"{devices} device(s): at most {max_share * devices}")
    if weights == AUTO:
        return
    sizes = shares(batch, weights)
    worst = max(range(len(sizes)), key=lambda i: sizes[i])
    if sizes[worst] > max_share:
        raise UsageError(f"{param('split')} {format_shares(weights)} gives device {worst} "
                         f"{sizes[worst]} of {batch} samples, over {param('max_share')} "
                         f"{max_share}")


def split_gain(batch: int, per_sample: Sequence[float], weights: Sequence[float]) -> float:
    """How many times faster than the even split ``weights`` can make a step of ``batch``, the
    slowest device (``per_sample``: its seconds per sample) setting the pace."""
    even = shares(batch, [1.0] * len(per_sample))
    return _pace(even, per_sample) / _pace(shares(batch, weights), per_sample)


def _pace(sizes: Sequence[int], per_sample: Sequence[float]) -> float:  # the slowest's time
    return max(n * t for n, t in zip(sizes, per_sample))


def split_report(batch: int, devices: int, weights: Sequence[float] | None = None,
                 per_sample: Sequence[float] | None = None, sample_bytes: int = 0,
                 unit: str | None = None) -> list[str]:
    """Two lines: the split's shares, the input bytes leaving device 0, and its step time beside
    the even and the ideal split's (``per_sample``: seconds per sample per device, default 1)."""
    weights = tuple(weights) if weights is not None else (1.0,) * devices
    times = list(per_sample) if per_sample is not None else [1.0] * devices
    if len(times) != devices:
        raise UsageError(f"per_sample has {len(times)} entries for {devices} device(s)")
    sizes = shares(batch, weights)
    ideal = shares(batch, [1.0 / t for t in times])
    unit = unit or ("s" if per_sample is not None else " sample-times")
    even = shares(batch, [1.0] * devices)
    return [f"split {format_shares(sizes)} of {batch} (weights {format_shares(weights)}): "
            f"{(batch - sizes[0]) * sample_bytes / 1e6:.2f} MB of inputs leave device 0",
            f"expected step (slowest device): {_pace(sizes, times):g}{unit}; even split "
            f"{format_shares(even)}: {_pace(even, times):g}{unit}; ideal split "
            f"{format_shares(ideal)}: {_pace(ideal, times):g}{unit}"]


class BatchSplit:
    """The one owner of ``--split`` and ``--max-share`` over ``count`` devices or ranks
    (``split``: weights, ``"auto"`` or ``None`` for even): each batch's sizes, the refusals,
    what ``--split auto`` observed, and the checkpoint state.

    Each share's own work is summed by :meth:`record` over an optimizer step and observed once by
    :meth:`step`. ``by_loader`` (ddp): the loader cuts each global batch, so a move lands at a
    later batch, alike on every rank (``reduce`` sums the ranks' records). ``steps_itself`` (a
    ``DataParallel``'s own split): a :meth:`timed` forward is observed at the next :meth:`sizes`.
    """

    steps_itself = False  # the class's, for an object pickled before these existed
    _unobserved = False  # a timed forward's records wait for the next sizes()

    def __init__(self, split, count: int, max_share: int | None = None, *,
                 by_loader: bool = False, reduce: Callable | None = None,
                 clock: Callable | None = None, steps_itself: bool = False):
        self.count, self.max_share, self.by_loader = count, max_share, by_loader
        self.fixed = None if split is None or split == AUTO else tuple(split)
        self.auto = AutoSplit(count) if split == AUTO else None
        self.reduce, self.clock, self.steps_itself = reduce, clock, steps_itself
        self._schedule: list[tuple[int, int, tuple[float, ...]]] = []  # (epoch, batch, w)
        self._last_batch: int | None = None
        self.discard()  # the records, and the backward's span (see time_backward_start)
        self._shown = self.weights()  # the weights :meth:`step` last reported

    @property
    def active(self) -> bool:
        """Whether a batch is cut by this object rather than evenly."""
        return self.fixed is not None or self.auto is not None or self.max_share is not None

    def weights(self) -> tuple[float, ...] | None:
        """The weights now (``None``: even shares)."""
        return tuple(self.auto.weights) if self.auto is not None else self.fixed

    def check_weights(self, name: str = "split") -> None:
        """Refuse weights that are not one valid weight per device."""
        if self.fixed is not None:
            self.fixed = check_weights(self.fixed, self.count, name)

    def check_fits(self, batch: int, what: str = param("batch_size")) -> None:
        """Refuse a ``batch`` the ``--max-share`` caps cannot hold."""
        check_max_share(batch, self.fixed or AUTO, self.count, self.max_share, what)

    def sizes(self, batch: int, epoch: int | None = None, index: int | None = None
              ) -> list[int] | None:
        """Each device's samples of ``batch`` (``None``: even); with ``(epoch, index)``, those of
        that global batch under the moves scheduled so far."""
        if self._unobserved:  # the last timed forward's work is long done by now
            self._unobserved = False
            self.step(0, 0)
        if not self.active:
            return None
        weights = self.weights()
        if index is not None and self.auto is not None:  # the last move made by that batch
            weights = next((w for at_epoch, at_batch, w in reversed(self._schedule)
                            if (at_epoch, at_batch) <= (epoch, index)), (1.0,) * self.count)
        check_max_share(batch, AUTO, self.count, self.max_share, "a batch of")  # caps move the rest
        self._last_batch = batch
        return capped(batch, weights or (1.0,) * self.count, self.max_share)

    def loader_split(self) -> Callable | None:
        """What the loader cuts each global batch by (``make_loader``'s ``split``)."""
        if not self.by_loader or self.weights() is None:
            return None
        return lambda epoch, index, size: self.sizes(size, epoch, index)

    def record(self, index: int, samples: int, seconds: float | Span) -> None:
        """Device ``index`` spent ``seconds`` (or a stopped ``Span``, read at :meth:`step`) on
        ``samples`` samples."""
        self._samples[index] += samples
        self._seconds[index].append(seconds)

    def timed(self, replicas: Sequence, devices: Sequence, shares: Sequence[int] | None,
              training: bool) -> list:
        """``replicas`` made to record their forward's span with their share when ``--split auto``
        times a training forward, else as they are (with ``steps_itself`` observed at the next
        :meth:`sizes`: at once, it would wait for the device)."""
        if self.auto is None or not training or not torch.is_grad_enabled() or shares is None:
            return replicas
        for i, n in enumerate(shares):
            if not n:
                self.record(i, 0, 0.0)
        self._unobserved = self.steps_itself
        busy = [i for i, n in enumerate(shares) if n]
        if len(busy) != len(replicas):  # an empty batch (one replica, no samples): no time
            return list(replicas)
        return [_timed(run, device, self, i, shares[i])
                for run, device, i in zip(replicas, devices, busy)]

    def discard(self) -> None:
        """Forget what was recorded since the last :meth:`step` (the ``--compile`` warm-up)."""
        self._samples, self._seconds = [0] * self.count, [[] for _ in range(self.count)]
        self._backward: Span | None = None

    def time_backward_end(self, index: int, model) -> list:
        """Hook ``model`` so that its backward, up to its first parameter's gradient (the last
        computed), counts as device ``index``'s work; the handles."""
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if self.auto is None or first is None:
            return []
        return [first.register_post_accumulate_grad_hook(lambda p: self._backward_done(index))]

    def time_backward_start(self, loss) -> None:
        """Start the backward's span at ``loss``'s gradient, on its device."""
        if loss.requires_grad:
            loss.register_hook(lambda grad: setattr(self, "_backward", Span(grad.device)))

    def _backward_done(self, index: int) -> None:
        span, self._backward = self._backward, None
        if span is not None:
            self.record(index, 0, span.stop())

    def step(self, epoch: int, batch: int, ahead: int = 0) -> bool:
        """After an optimizer step: observe it, let ``--split auto`` move the weights; whether they
        moved. ``(epoch, batch)``: the next batch; ``ahead``: batches drawn past it."""
        if self.auto is not None and (self.reduce is not None or any(self._samples)):
            self._observe(epoch)
            # shares cut at the forward: move only when the next batch's shares change
            if self.auto.adjust(None if self.by_loader else self._last_batch):
                self._schedule.append((epoch, batch + ahead, tuple(self.auto.weights)))
        shown, self._shown = self._shown, self.weights()
        return self._shown != shown

    def _observe(self, epoch: int) -> None:
        samples = self._samples
        seconds = [sum(seconds_of(s) for s in spans) for spans in self._seconds]
        if self.reduce is not None:  # every rank gets every rank's record: alike decisions
            both = self.reduce(torch.tensor([*samples, *seconds], dtype=torch.float64)).tolist()
            samples, seconds = [int(n) for n in both[:self.count]], both[self.count:]
        if self.clock is not None:
            seconds = [self.clock(i, n, t) if n else 0.0
                       for i, (n, t) in enumerate(zip(samples, seconds))]
        self.discard()
        self.auto.observe(samples, seconds)
        self.auto.at_epoch(epoch)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps (``None``: nothing, the split is fixed)."""
        if self.auto is None:
            return None
        return {"auto": self.auto.state_dict(),
                "schedule": [[e, b, list(w)] for e, b, w in self._schedule]}

    def load_state_dict(self, state: dict | None) -> None:
        if state and self.auto is not None:
            self.auto.load_state_dict(state["auto"])
            self._schedule = [(int(e), int(b), tuple(w)) for e, b, w in state.get("schedule", [])]
            self._shown = self.weights()


def _timed(module, device, split: BatchSplit, index: int, samples: int):
    """``module`` called with its span on ``device`` recorded in ``split`` as device ``index``'s."""
    def run(*args, **kwargs):
        span = Span(device)
        out = module(*args, **kwargs)
        split.record(index, samples, span.stop())
        return out
    return run
