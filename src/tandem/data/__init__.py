"""tandem.data: datasets and loaders whose batches depend only on ``(seed, epoch)``.

    train_ds, val_ds, info = load_dataset("digits", augment="standard")
    loader = make_loader(train_ds, 128, shuffle=True, seed=0, epoch=0, workers=2)
"""

from .dataset import DatasetInfo, ImageDataset
from .device import Normalization, batch_to_device
from .load import DATASET_NAMES, load_dataset
from .loader import (LoaderCache, ShardedBatchSampler, batches_per_epoch, epoch_order, make_loader)

__all__ = ["load_dataset", "make_loader", "DatasetInfo"]
