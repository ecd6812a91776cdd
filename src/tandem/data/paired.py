"""A mixed batch through the DataLoader: a share's own samples, the partners it lacks, and how
to mix them (:class:`~.mixing.Pairing`), collated as ``(images, targets, pairing)``.

Under ddp a rank loads, on average, ``1 - 1/ranks`` of its share again as partners.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from .mixing import Pairing


def delegating(attr: str, *own: str):
    """A wrapper's ``__getattr__`` (called only for what its class lacks): ``self.<attr>``'s;
    ``attr`` and ``own``, not set yet while unpickling, raise (no recursion)."""
    def __getattr__(self, name):
        if name == attr or name in own:
            raise AttributeError(name)
        return getattr(getattr(self, attr), name)
    return __getattr__


class PairedShare(list):
    """A share's sample keys, or the samples read for them (its own, then the extra partners),
    with its ``pairing``."""

    def __init__(self, items, pairing: Pairing):
        super().__init__(items)
        self.pairing = pairing

    def __reduce__(self):  # to the workers: the keys and the pairing
        return PairedShare, (list(self), self.pairing)


class Paired(Dataset):
    """``dataset`` read a share at a time (``__getitems__``), collated with its pairing; any
    other attribute is ``dataset``'s."""

    def __init__(self, dataset, collate):
        self.dataset, self._collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    __getattr__ = delegating("dataset", "_collate")

    def __getitem__(self, key):
        return self.dataset[key]

    def __getitems__(self, keys: PairedShare) -> PairedShare:
        inner = getattr(self.dataset, "__getitems__", None)
        samples = inner(list(keys)) if inner is not None else [self.dataset[k] for k in keys]
        return PairedShare(samples, keys.pairing)

    def collate(self, fetched: PairedShare):
        """``(images, targets, pairing)`` of one share."""
        return (*self._collate(list(fetched)), fetched.pairing)
