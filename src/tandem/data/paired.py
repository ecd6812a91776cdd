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


class PairedKeys(list):
    """A share's sample keys (its own, then the extra partners), with its ``pairing``."""

    def __init__(self, keys, pairing: Pairing):
        super().__init__(keys)
        self.pairing = pairing

    def __reduce__(self):  # to the workers: the keys and the pairing
        return PairedKeys, (list(self), self.pairing)


class Fetched(list):
    """The samples of a :class:`PairedKeys` list, with its ``pairing``."""

    def __init__(self, samples, pairing: Pairing):
        super().__init__(samples)
        self.pairing = pairing


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

    def __getitems__(self, keys: PairedKeys) -> Fetched:
        inner = getattr(self.dataset, "__getitems__", None)
        samples = inner(list(keys)) if inner is not None else [self.dataset[k] for k in keys]
        return Fetched(samples, keys.pairing)

    def collate(self, fetched: Fetched):
        """``(images, targets, pairing)`` of one share."""
        return (*self._collate(list(fetched)), fetched.pairing)
