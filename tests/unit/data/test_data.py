"""load_dataset for the built-in data, and make_loader's ordering/sharding/resume contract."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from tandem.data import DatasetInfo, batches_per_epoch, epoch_order, load_dataset, make_loader
from tandem.data.dataset import stratified_split
from tandem.parallel.shares import shares
from tandem.data.digits import SPLIT_SEED, VAL_FRACTION


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", augment="standard")


def small_synth(n=23, augment="standard", **kw):
    train, _, _ = load_dataset("synthetic", augment=augment, synthetic_size=n, image_size=8, **kw)
    return train


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


# -- names, paths and errors -----------------------------------------------------------------

def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="synthetic, digits"):
        load_dataset("imagenet_nope")


def test_missing_path_is_file_not_found(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"data path '{missing}' does not exist"):
        load_dataset(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("./surely_missing_dir")


def test_path_to_a_file_is_rejected(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("hi")
    with pytest.raises(ValueError, match="not a directory"):
        load_dataset(str(f))


def test_bad_augment_and_num_classes():
    with pytest.raises(ValueError, match="augment"):
        load_dataset("synthetic", augment="heavy")
    with pytest.raises(ValueError, match="10 classes"):
        load_dataset("digits", num_classes=5)
    with pytest.raises(ValueError, match="synthetic_size"):
        load_dataset("synthetic", synthetic_size=0)


@pytest.mark.parametrize("spec, options", [("synthetic", {"synthetic_size": 40}),
                                           ("digits", {})])
def test_splits_builds_only_the_split_asked_for(spec, options):
    """``splits=("val",)`` (eval's) gives no training set and the same validation set."""
    _, val, info = load_dataset(spec, image_size=8, **options)
    train_only, none, info_t = load_dataset(spec, image_size=8, splits=("train",), **options)
    none2, val_only, info_v = load_dataset(spec, image_size=8, splits=("val",), **options)
    assert none is None and none2 is None and train_only is not None
    assert info_v == info_t == info and len(val_only) == len(val)
    assert all(torch.equal(val_only[i][0], val[i][0]) and val_only[i][1] == val[i][1]
               for i in range(len(val)))
    for bad in ((), ("test",), ("val", "bogus")):
        with pytest.raises(ValueError, match="splits must name one or more of train, val"):
            load_dataset(spec, splits=bad, **options)


# -- synthetic -----------------------------------------------------------------------------

def test_synthetic_defaults_and_options():
    train, val, info = load_dataset("synthetic")
    assert info == DatasetInfo("synthetic", 10, 3, 32, [str(i) for i in range(10)])
    assert (len(train), len(val)) == (1024, 256)
    x, y = train[5]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    train, val, info = load_dataset("synthetic", synthetic_size=40, num_classes=3, image_size=12)
    assert (len(train), len(val), info.num_classes, info.image_size) == (40, 10, 3, 12)
    assert {train[i][1] for i in range(40)} <= {0, 1, 2}


def test_synthetic_is_seeded_and_splits_differ():
    a, va, _ = load_dataset("synthetic", synthetic_size=8, seed=1)
    b, _, _ = load_dataset("synthetic", synthetic_size=8, seed=1)
    c, _, _ = load_dataset("synthetic", synthetic_size=8, seed=2)
    assert torch.equal(a[3][0], b[3][0])
    assert not torch.equal(a[3][0], c[3][0])
    assert not torch.equal(a[0][0], va[0][0])


def test_synthetic_is_learnable():
    # a nearest-class-mean classifier on the training split beats chance by far on val
    train, val, info = load_dataset("synthetic", synthetic_size=400, image_size=8)
    xs = torch.stack([train[i][0] for i in range(len(train))]).flatten(1)
    ys = torch.tensor([train[i][1] for i in range(len(train))])
    means = torch.stack([xs[ys == c].mean(0) for c in range(info.num_classes)])
    vx = torch.stack([val[i][0] for i in range(len(val))]).flatten(1)
    vy = torch.tensor([val[i][1] for i in range(len(val))])
    acc = (torch.cdist(vx, means).argmin(1) == vy).float().mean()
    assert acc > 0.5


# -- digits --------------------------------------------------------------------------------

def test_stratified_split():
    labels = [0] * 10 + [1] * 5 + [2]
    train, val = stratified_split(labels, 0.2, 0)
    assert sorted(train + val) == list(range(16)) and not set(train) & set(val)
    assert [labels[i] for i in val].count(0) == 2 and [labels[i] for i in val].count(1) == 1
    assert 15 in train  # a one-sample class stays in train
    assert stratified_split(labels, 0.2, 0) == (train, val)
    assert stratified_split(labels, 0.2, 1) != (train, val)


def test_digits_split_is_fixed_stratified_and_disjoint(digits):
    train, val, info = digits
    assert info == DatasetInfo("digits", 10, 1, 8, [str(i) for i in range(10)])
    assert len(train) + len(val) == 1797
    assert 0.18 < len(val) / 1797 < 0.22
    train_counts = np.bincount(train.labels, minlength=10)
    val_counts = np.bincount(val.labels, minlength=10)
    ratio = val_counts / (train_counts + val_counts)
    assert np.all((ratio > 0.15) & (ratio < 0.25))  # every class split ~80/20
    # the split partitions the 1797 images
    train_idx, val_idx = stratified_split(load_digits().target.tolist(), VAL_FRACTION, SPLIT_SEED)
    assert not set(train_idx) & set(val_idx) and len(train_idx) + len(val_idx) == 1797
    assert len(val_idx) == len(val)
    # the split ignores the training seed
    _, val2, _ = load_dataset("digits", seed=123)
    assert np.array_equal(val2.images, val.images) and SPLIT_SEED == 0


def test_digits_read_from_scikit_learn_s_file_equal_its_loader(monkeypatch):
    """The bundled file read directly (no sklearn.datasets import) gives load_digits' arrays,
    and where the file is not found, load_digits itself is used: the same arrays again."""
    from tandem.data import digits as module

    bunch = load_digits()
    for found in (True, False):
        if not found:
            monkeypatch.setattr(module.os.path, "isfile", lambda path: False)
        images, labels = module._bundled_digits()
        assert images.shape == (1797, 8, 8) and labels.dtype == np.int64
        assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    monkeypatch.undo()
    images, _ = module._bundled_digits()
    images[0, 0, 0] += 1  # the negative control: a changed pixel is seen
    assert not np.array_equal(images, bunch.images)


def test_digits_normalised_and_val_not_augmented(digits):
    train, val, _ = digits
    xs = torch.stack([train[(i, 0, 0)][0] for i in range(0, len(train), 3)])
    assert xs.shape[1:] == (1, 8, 8)
    assert abs(float(xs.mean())) < 0.15 and 0.8 < float(xs.std()) < 1.2
    assert val.augment == "none"
    assert torch.equal(val[(4, 1, 0)][0], val[(4, 7, 3)][0])


def test_digits_standard_augment_shifts_but_never_flips(digits):
    train, _, _ = digits
    plain, _, _ = load_dataset("digits")
    x0 = plain[10][0]
    background = x0.min()  # value of a zero pixel after normalisation
    changed = 0
    for epoch in range(20):
        x = train[(10, 0, epoch)][0]
        if not torch.equal(x, x0):
            changed += 1
        # the result is x0 shifted by at most one pixel (zero-filled); a flip would not match
        ok = False
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                shifted = torch.full_like(x0, float(background))
                ys, yd = (slice(0, 8 - dy), slice(dy, 8)) if dy >= 0 else \
                    (slice(-dy, 8), slice(0, 8 + dy))
                xs, xd = (slice(0, 8 - dx), slice(dx, 8)) if dx >= 0 else \
                    (slice(-dx, 8), slice(0, 8 + dx))
                shifted[:, yd, xd] = x0[:, ys, xs]
                ok |= torch.allclose(shifted, x)
        assert ok, f"epoch {epoch}: not a <=1 pixel shift of the original"
    assert changed >= 10


def test_digits_upsampled(digits):
    train, val, info = load_dataset("digits", image_size=16)
    assert info.image_size == 16 and train[0][0].shape == (1, 16, 16)
    assert train.pad == 2


# -- make_loader -----------------------------------------------------------------------------

def test_shard_sizes():
    def shard_sizes(batch, world):
        return shares(batch, [1] * world)  # the loader's rule
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(9, 4) == [3, 2, 2, 2]  # never empty while batch >= world size
    assert shard_sizes(2, 4) == [1, 1, 0, 0]
    assert shard_sizes(7, 1) == [7]
    for b in range(0, 20):
        for w in range(1, 6):
            s = shard_sizes(b, w)
            assert sum(s) == b and max(s) - min(s) <= 1 and s == sorted(s, reverse=True)


def test_order_depends_only_on_seed_and_epoch():
    a = epoch_order(50, shuffle=True, seed=3, epoch=1)
    assert torch.equal(a, epoch_order(50, shuffle=True, seed=3, epoch=1))
    assert not torch.equal(a, epoch_order(50, shuffle=True, seed=3, epoch=2))
    assert not torch.equal(a, epoch_order(50, shuffle=True, seed=4, epoch=1))
    assert sorted(a.tolist()) == list(range(50))
    assert epoch_order(5, shuffle=False, seed=3, epoch=1).tolist() == [0, 1, 2, 3, 4]


def test_global_batches_cover_every_sample_once():
    ds = small_synth(23)
    got = batches(make_loader(ds, 5, shuffle=True, seed=0, epoch=0))
    assert [len(y) for _, y in got] == [5, 5, 5, 5, 3]
    order = epoch_order(23, shuffle=True, seed=0, epoch=0).tolist()
    expect = torch.stack([ds[(i, 0, 0)][0] for i in order])
    assert torch.equal(torch.cat([x for x, _ in got]), expect)
    assert len(make_loader(ds, 5, shuffle=True, seed=0, epoch=0)) == 5


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n,batch", [(23, 5), (10, 4), (9, 8), (5, 2), (1, 3)])
def test_rank_shards_rebuild_the_global_batches(world, n, batch):
    ds = small_synth(n)
    ref = batches(make_loader(ds, batch, shuffle=True, seed=1, epoch=2))
    per_rank = [batches(make_loader(ds, batch, shuffle=True, seed=1, epoch=2, rank=r,
                                    world_size=world)) for r in range(world)]
    for r in range(world):  # every rank runs the same number of steps
        loader = make_loader(ds, batch, shuffle=True, seed=1, epoch=2, rank=r, world_size=world)
        assert len(per_rank[r]) == len(ref) == len(loader)
    for step, (x, y) in enumerate(ref):
        shards = [per_rank[r][step] for r in range(world)]
        assert [len(s[1]) for s in shards] == shares(len(y), [1] * world)
        assert torch.equal(torch.cat([s[0] for s in shards]), x)  # contiguous, in rank order
        assert torch.equal(torch.cat([s[1] for s in shards]), y)
        for sx, sy in shards:  # empty shards still have the right shape and dtype
            assert sx.shape[1:] == (3, 8, 8) and sy.dtype == torch.int64


def test_validation_counts_every_sample_once_across_ranks():
    _, val, _ = load_dataset("synthetic", synthetic_size=40, image_size=8)  # 10 val samples
    total, labels = 0, []
    for r in range(3):
        for x, y in make_loader(val, 4, shuffle=False, seed=0, epoch=0, rank=r, world_size=3):
            total += len(y)
            labels += y.tolist()
    assert total == len(val)
    assert sorted(labels) == sorted(val[i][1] for i in range(len(val)))


def test_short_last_batch_gives_empty_batches_to_trailing_ranks():
    ds = small_synth(9)  # global batches of 4: [4, 4, 1]
    sizes = [[len(y) for _, y in make_loader(ds, 4, shuffle=True, seed=0, epoch=0, rank=r,
                                             world_size=3)] for r in range(3)]
    assert sizes == [[2, 2, 1], [1, 1, 0], [1, 1, 0]]
    x, y = list(make_loader(ds, 4, shuffle=True, seed=0, epoch=0, rank=2, world_size=3))[-1]
    assert x.shape == (0, 3, 8, 8) and y.shape == (0,) and y.dtype == torch.int64


@pytest.mark.parametrize("n, batch", [(23, 4), (24, 4), (1, 4), (5, 1), (3, 8)])
def test_batches_per_epoch_is_what_the_loader_yields_without_building_one(n, batch):
    ds = small_synth(n, augment="none")
    assert batches_per_epoch(ds, batch) == len(list(make_loader(ds, batch, shuffle=True, seed=0,
                                                                epoch=0))) == -(-n // batch)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        batches_per_epoch(ds, 0)


@pytest.mark.parametrize("world", [1, 3])
def test_start_batch_resumes_exactly(world):
    ds = small_synth(23)
    for r in range(world):
        full = batches(make_loader(ds, 4, shuffle=True, seed=5, epoch=1, rank=r,
                                   world_size=world))
        rest = make_loader(ds, 4, shuffle=True, seed=5, epoch=1, rank=r, world_size=world,
                           start_batch=4)
        assert len(rest) == len(full) - 4 == rest.batch_sampler.total_batches - 4
        for (a, ya), (b, yb) in zip(full[4:], batches(rest), strict=True):
            assert torch.equal(a, b) and torch.equal(ya, yb)
    assert len(make_loader(ds, 4, shuffle=True, seed=5, epoch=1, start_batch=6)) == 0


def test_start_batch_does_not_load_skipped_samples():
    ds = small_synth(20, augment="none")
    loaded = []
    original = type(ds).raw

    class Spy(type(ds)):
        def raw(self, index):
            loaded.append(index)
            return original(self, index)

    ds.__class__ = Spy
    list(make_loader(ds, 4, shuffle=False, seed=0, epoch=0, start_batch=3))
    assert sorted(loaded) == list(range(12, 20))


def test_workers_do_not_change_batches_or_augmentation():
    ds = small_synth(21)
    a = batches(make_loader(ds, 4, shuffle=True, seed=2, epoch=3, workers=0))
    b = batches(make_loader(ds, 4, shuffle=True, seed=2, epoch=3, workers=2))
    assert len(a) == len(b) == 6
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_augmentation_depends_on_seed_and_epoch_but_not_rank():
    ds = small_synth(8)
    x0 = ds[(3, 0, 0)][0]
    assert torch.equal(x0, ds[(3, 0, 0)][0])
    assert any(not torch.equal(x0, ds[(3, 0, e)][0]) for e in range(1, 6))
    assert any(not torch.equal(x0, ds[(3, s, 0)][0]) for s in range(1, 6))
    # the same sample reached through different ranks / world sizes is identical
    one = torch.cat([x for x, _ in make_loader(ds, 8, shuffle=True, seed=4, epoch=1)])
    two = torch.cat([x for r in range(2) for x, _ in make_loader(
        ds, 8, shuffle=True, seed=4, epoch=1, rank=r, world_size=2)])
    assert torch.equal(one, two)


def test_iterating_leaves_the_global_rng_alone():
    ds = small_synth(10)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    for workers in (0, 2):
        list(make_loader(ds, 3, shuffle=True, seed=0, epoch=0, workers=workers))
    assert torch.equal(state, torch.get_rng_state())


def test_bad_loader_arguments():
    ds = small_synth(10)
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(ds, 0, shuffle=True, seed=0, epoch=0)
    with pytest.raises(ValueError, match="rank"):
        make_loader(ds, 2, shuffle=True, seed=0, epoch=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="start_batch"):
        make_loader(ds, 2, shuffle=True, seed=0, epoch=0, start_batch=6)
    with pytest.raises(ValueError, match="workers"):
        make_loader(ds, 2, shuffle=True, seed=0, epoch=0, workers=-1)


def test_index_out_of_range():
    ds = small_synth(4)
    with pytest.raises(IndexError, match="out of range"):
        ds[4]


def test_synthetic_cached_and_generated_samples_agree(monkeypatch):
    from tandem.data import synthetic

    cached, _, _ = load_dataset("synthetic", synthetic_size=12, image_size=8)
    monkeypatch.setattr(synthetic, "CACHE_BYTES", 0)
    lazy, _, _ = load_dataset("synthetic", synthetic_size=12, image_size=8)
    assert cached._cache is not None and lazy._cache is None
    for i in range(12):
        assert torch.equal(cached[(i, 3, 1)][0], lazy[(i, 3, 1)][0])
        assert cached[i][1] == lazy[i][1]
    longer, _, _ = load_dataset("synthetic", synthetic_size=20, image_size=8)
    assert torch.equal(longer[5][0], cached[5][0])  # a sample does not depend on the size


@pytest.mark.cuda
def test_pinned_loader_feeds_cuda():
    ds = small_synth(10)
    loader = make_loader(ds, 4, shuffle=True, seed=0, epoch=0, workers=2, pin_memory=True,
                         rank=2, world_size=3)
    sizes = []
    for x, y in loader:
        assert x.is_pinned() or x.numel() == 0  # an empty tensor has no memory to pin
        sizes.append(x.cuda(non_blocking=True).shape[0])
    assert sizes == [1, 1, 0]
