"""A mixed batch through the DataLoader: a share's own samples, the partners it lacks, and how
to mix them.

The batch sampler (main process) draws each global batch's :class:`~.mixing.MixDraw` and
yields, for this rank's share, the keys of its own samples followed by those of the partners
it does not hold, as :class:`PairedKeys` (a list that carries the share's
:class:`~.mixing.Pairing`, and reaches the workers pickled). :class:`Paired` wraps the data set
so that the DataLoader hands it the whole list (``__getitems__``) and its collate returns
``(images, targets, pairing)``; the step mixes them on the device (:func:`~.mixing.mix`). In
one process every partner is in the batch already: nothing is loaded twice. Under ddp a rank
loads, on average, ``1 - 1/ranks`` of its share again as partners.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from .mixing import Pairing

__all__ = ["PairedKeys", "Paired", "Fetched"]


class PairedKeys(list):
    """A share's sample keys (its own, then the extra partners), with its ``pairing``."""

    def __init__(self, keys, pairing: Pairing):
        super().__init__(keys)
        self.pairing = pairing

    def __reduce__(self):  # to the workers: the keys and the pairing
        return PairedKeys, (list(self), self.pairing)


class Fetched(list):
    """The samples of a :class:`PairedKeys` list, with its ``pairing``: what
    :meth:`Paired.__getitems__` gives the collate."""

    def __init__(self, samples, pairing: Pairing):
        super().__init__(samples)
        self.pairing = pairing


class Paired(Dataset):
    """``dataset`` read a share at a time, its batches collated by ``collate`` into
    ``(images, targets)`` and given their pairing; anything else (length, shape,
    normalization, ``finish_loader``) is ``dataset``'s."""

    def __init__(self, dataset, collate):
        self.dataset, self._collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # what this class lacks: the data set's
        if name in ("dataset", "_collate"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key):
        return self.dataset[key]

    def __getitems__(self, keys: PairedKeys) -> Fetched:
        inner = getattr(self.dataset, "__getitems__", None)
        samples = inner(list(keys)) if inner is not None else [self.dataset[k] for k in keys]
        return Fetched(samples, keys.pairing)

    def collate(self, fetched: Fetched):
        """``(images, targets, pairing)`` of one share."""
        return (*self._collate(list(fetched)), fetched.pairing)
