"""What one bench contestant is, as a value: an :class:`Entry`, and :func:`lineup`, every entry
of a run in table order.

An entry's ``name`` (``"dp/auto+amp+cl+compile/loop"``) is rendered from its fields, never
parsed back: the name is for tables, JSON and BENCHMARKS.md; the torchrun workers get the entry
itself as JSON. Building an entry into a runnable :class:`~.contestants.Contestant` is
:mod:`.suite`'s and :mod:`.distributed`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.strategies import strategy_class, strategy_names

from .variants import Variant, variants_of

COMPILED = "+compile"  # suffix of a compiled twin ("single+compile")
LOOP = "/loop"  # suffix of a strategy's loop twin ("dp+amp/loop"), last in every name
# baselines timed under torchrun, one process per device (see .distributed)
TORCHRUN_BASELINES = ("torch_ddp",)


@dataclass(frozen=True)
class Entry:
    """One contestant: a tandem strategy or a plain-torch baseline, and how it is raced.

    ``split`` is the ``--split`` it runs with: ``None`` (equal shares), ``"auto"``, or a tuple
    of weights (``--handicap``'s ideal shares, named ``/ideal``). ``variant`` is its precision
    and layout (:mod:`.variants`), ``compiled`` its ``+compile`` twin, ``loop`` its ``/loop``
    twin (:mod:`.loop`); ``handicap`` ``(I, F)`` slows replica or rank I (strategies only).
    """

    base: str  # a registered strategy's name, or one of config.BASELINES
    kind: str = "strategy"  # or "baseline"
    split: str | tuple[float, ...] | None = None
    variant: Variant = Variant()
    compiled: bool = False
    loop: bool = False
    handicap: tuple[int, float] | None = None

    @property
    def name(self) -> str:
        """``base``, then ``/auto`` or ``/ideal``, the variant's suffix, ``+compile``, ``/loop``."""
        split = "" if self.split is None else "/auto" if self.split == "auto" else "/ideal"
        return (self.base + split + self.variant.suffix + (COMPILED if self.compiled else "")
                + (LOOP if self.loop else ""))

    @property
    def multiprocess(self) -> bool:
        """Raced under torchrun, one process per device (not interleaved in this process)."""
        if self.kind == "baseline":
            return self.base in TORCHRUN_BASELINES
        return strategy_class(self.base).multiprocess

    def step_twin(self) -> "Entry":
        """The bench step that this loop twin runs inside the train loop."""
        return replace(self, loop=False)

    def eager_twin(self) -> "Entry":
        """This entry uncompiled."""
        return replace(self, compiled=False)

    def plain_twin(self) -> "Entry":
        """This entry unsuffixed by variant (fp32, contiguous) and uncompiled."""
        return replace(self, variant=Variant(), compiled=False)

    def to_json(self) -> dict:
        """JSON-ready fields (for the torchrun workers); :meth:`from_json` reads them back."""
        v = self.variant
        return {"base": self.base, "kind": self.kind,
                "split": list(self.split) if isinstance(self.split, tuple) else self.split,
                "variant": {"amp": v.amp, "channels_last": v.channels_last, "suffix": v.suffix},
                "compiled": self.compiled, "loop": self.loop,
                "handicap": None if self.handicap is None else list(self.handicap)}

    @classmethod
    def from_json(cls, data: dict) -> "Entry":
        split, handicap = data["split"], data["handicap"]
        return cls(base=data["base"], kind=data["kind"],
                   split=tuple(split) if isinstance(split, list) else split,
                   variant=Variant(**data["variant"]), compiled=data["compiled"],
                   loop=data["loop"], handicap=None if handicap is None else tuple(handicap))


def _splits(config, name: str) -> tuple[list, tuple[int, float] | None]:
    """The splits strategy ``name`` races with, and its handicap: with ``--handicap``, equal,
    ``auto`` and ideal shares when it splits the batch (a model it must split itself, such as
    hybrid's, is raced as it is, unhandicapped)."""
    cls = strategy_class(name)
    if config.handicap is None or not cls.splits_batch or not cls.takes_any_model():
        return [None], None
    return [None, "auto", config.ideal_split()], config.handicap_spec()


def _strategies(config) -> list[str]:
    """``config.strategies``, and where one of them is multi-process, every other
    multi-process strategy after the last one named: the torchrun phase races them side by
    side (ddp and hybrid-ddp; one that cannot take the model says why in its row)."""
    names = list(config.strategies)
    multi = [n for n in names if strategy_class(n).multiprocess]
    if multi:
        at = names.index(multi[-1]) + 1
        names[at:at] = [n for n in strategy_names(multiprocess=True) if n not in names]
    return names


def lineup(config) -> list[Entry]:
    """Every contestant of ``config`` (a :class:`~.config.BenchConfig`) in table order:
    ``bare``, the strategies (each split; every multi-process one once one is named),
    ``torch_dp``, ``torch_ddp``; per contestant its variants, each followed by its compiled
    twin; a strategy's each followed by its loop twin."""
    twins = [(v, c) for v in variants_of(config)
             for c in ((False, True) if config.compile else (False,))]
    loops = (False, True) if config.loop else (False,)
    entries = [Entry("bare", "baseline", variant=v, compiled=c)
               for v, c in twins if "bare" in config.baselines]
    for name in _strategies(config):
        splits, handicap = _splits(config, name)
        entries += [Entry(name, split=s, variant=v, compiled=c, loop=loop, handicap=handicap)
                    for s in splits for v, c in twins for loop in loops]
    for base in ("torch_dp", "torch_ddp"):
        entries += [Entry(base, "baseline", variant=v, compiled=c)
                    for v, c in twins if base in config.baselines]
    return entries
