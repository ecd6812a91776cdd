"""Loaders whose global batches depend only on ``(seed, epoch)``.

Global batch ``b`` is ``order[b*B:(b+1)*B]`` of a permutation seeded by ``(seed, epoch)``;
nothing is dropped, padded or repeated; rank ``r`` loads its contiguous share. Warning: a last
batch smaller than the ranks gives trailing ranks an *empty* batch (a zero-sample step).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from tandem.errors import UsageError
from tandem.parallel.shares import shares

from .mixing import Mixing, pair
from .paired import Paired, PairedShare
from .transforms import mix_seed

PREFETCH = 4  # batches in flight per worker


def batches_per_epoch(dataset, batch_size: int) -> int:
    """Global batches in one epoch of ``dataset``: ``ceil(len / batch_size)``, none dropped."""
    _check_int("batch_size", batch_size, 1)
    return -(-len(dataset) // batch_size)


def rank_rows(num_samples: int | None, batch_size: int, batch: int, rank: int = 0,
              world_size: int = 1, split=None, epoch: int = 0) -> tuple[int, int]:
    """``(first, count)``: rank ``rank``'s rows of global batch ``batch`` of ``num_samples``
    (``None``: a whole batch); what the sampler yields and where keyed dropout places them."""
    left = batch_size if num_samples is None else num_samples - batch * batch_size
    size = max(0, min(batch_size, left))
    sizes = (shares(size, [1] * world_size) if split is None else split(epoch, batch, size))
    return sum(sizes[:rank]), sizes[rank]


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a function of ``(num_samples, shuffle, seed, epoch)`` only."""
    if not shuffle:
        return torch.arange(num_samples)
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=g)


class ShardedBatchSampler(Sampler):
    """Yields, per global batch, this rank's list of sample keys ``(index, seed, epoch)``.
    ``split``: ``None`` (even shares) or ``(epoch, batch, size) -> sizes`` (``--split``); with
    ``mix`` (:class:`~.mixing.Mixing`) the keys are followed by the partners' (:mod:`.paired`)."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, seed: int,
                 epoch: int, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                 split=None, mix: Mixing | None = None):
        _check_int("batch_size", batch_size, 1)
        _check_int("world_size", world_size, 1)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UsageError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.total_batches = batches_per_epoch(range(num_samples), batch_size)
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size, self.split = rank, world_size, split
        self.mix = mix if mix is not None and mix.active else None
        self.set_position(epoch, start_batch)

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Move to ``epoch``, skipping its first ``start_batch`` global batches."""
        _check_int("epoch", epoch, 0)
        _check_int("start_batch", start_batch, 0)
        if start_batch > self.total_batches:
            raise UsageError(f"start_batch {start_batch} is past the end of the epoch "
                             f"({self.total_batches} batches of {self.batch_size})")
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.total_batches - self.start_batch

    def __iter__(self):
        order = epoch_order(self.num_samples, shuffle=self.shuffle, seed=self.seed,
                            epoch=self.epoch).tolist()
        for b in range(self.start_batch, self.total_batches):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            lo, n = rank_rows(self.num_samples, self.batch_size, b, self.rank,
                              self.world_size, self.split, self.epoch)
            keys = [(i, self.seed, self.epoch) for i in batch[lo:lo + n]]
            if self.mix is None:
                yield keys
                continue
            pairing = pair(self.mix.draw(self.seed, self.epoch, b, len(batch)), lo, lo + n,
                           self.mix.num_classes)
            yield PairedShare(keys + [(batch[q], self.seed, self.epoch) for q in pairing.extra],
                              pairing)


def collate(samples: list, *, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
            target_shape: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(image, label)`` pairs, keeping the samples' layout (channels-last stays so); an
    empty list gives ``(0, *shape)`` and ``(0, *target_shape)`` tensors."""
    if not samples:
        return (torch.empty((0, *shape), dtype=dtype),
                torch.empty((0, *target_shape), dtype=torch.int64))
    images = [s[0] for s in samples]
    if all(x.dim() == 3 and x.permute(1, 2, 0).is_contiguous() for x in images):
        # HWC crops seen as CHW: a plain copy into a channels-last batch, no transpose
        images = torch.stack([x.permute(1, 2, 0) for x in images]).permute(0, 3, 1, 2)
    else:
        images = torch.stack(images)
    if target_shape:  # dense targets: one tensor of class indices per sample
        return images, torch.stack([torch.as_tensor(s[1], dtype=torch.int64) for s in samples])
    return images, torch.tensor([int(s[1]) for s in samples], dtype=torch.int64)


def _seed_worker(worker_id: int, *, base: int) -> None:
    s = mix_seed(base, worker_id)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an int >= {minimum}, got {value!r}")


def make_loader(dataset, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
                workers: int = 0, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                pin_memory: bool = False, persistent: bool = False, split=None,
                mix: Mixing | None = None) -> DataLoader:
    """A DataLoader over this rank's share of the epoch's global batches of ``batch_size``.
    ``dataset`` takes ``(index, seed, epoch)`` keys and has a ``shape`` (optionally ``dtype``,
    ``target_shape``) for empty batches, or its own ``collate`` (and ``finish_loader``); with
    ``mix`` each batch is ``(images, targets, pairing)``."""
    _check_int("workers", workers, 0)
    sampler = ShardedBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                  epoch=epoch, rank=rank, world_size=world_size,
                                  start_batch=start_batch, split=split, mix=mix)
    base = mix_seed(seed, epoch, 104729)
    collate_fn = getattr(dataset, "collate", None) or functools.partial(
        collate, shape=tuple(dataset.shape), dtype=getattr(dataset, "dtype", torch.float32),
        target_shape=tuple(getattr(dataset, "target_shape", ())))
    if sampler.mix is not None:
        dataset = Paired(dataset, collate_fn)
        collate_fn = dataset.collate
    loader = DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, collate_fn=collate_fn,
        worker_init_fn=functools.partial(_seed_worker, base=base) if workers else None,
        generator=torch.Generator().manual_seed(base),  # keeps the global RNG untouched
        pin_memory=pin_memory, persistent_workers=persistent and workers > 0,
        prefetch_factor=PREFETCH if workers else None)
    return dataset.finish_loader(loader) if hasattr(dataset, "finish_loader") else loader


class LoaderCache:
    """One DataLoader per ``(dataset, settings)`` with persistent workers, its sampler moved
    from epoch to epoch; batches are a fresh loader's (the keys are made in this process)."""

    def __init__(self):
        self._loaders: dict[tuple, tuple[object, DataLoader]] = {}

    def get(self, dataset, batch_size: int, *, epoch: int, start_batch: int = 0,
            **settings) -> DataLoader:
        key = (id(dataset), batch_size, *sorted(settings.items()))
        if key not in self._loaders:  # holding the dataset keeps its id unique
            self._loaders[key] = (dataset, make_loader(
                dataset, batch_size, epoch=epoch, start_batch=start_batch, persistent=True,
                **settings))
        loader = self._loaders[key][1]
        loader.batch_sampler.set_position(epoch, start_batch)
        return loader
