"""Keyed dropout and drop path against the whole batch's mask drawn at once, and against torch's
own layers' formulas (tandem.keyed)."""

import math

import pytest
import torch
from torch import nn

from tandem.keyed import (DropPath, KeyedAlphaDropout, KeyedDropout, KeyedDropout1d,
                          KeyedDropout2d, KeyedDropout3d, KeyedFeatureAlphaDropout,
                          drop_path_rates, keyed_dropout, step_stream)
from tandem.keyed import stream
from tandem.keyed.keys import mix_seed, threshold, words

LAYERS = [(nn.Dropout, (7, 30)), (nn.Dropout1d, (7, 5, 6)), (nn.Dropout2d, (7, 5, 3, 3)),
          (nn.Dropout3d, (7, 5, 2, 2, 2)), (nn.AlphaDropout, (7, 30)),
          (nn.FeatureAlphaDropout, (7, 5, 3, 3))]


def _net(kind, p=0.5):
    return keyed_dropout(nn.Sequential(kind(p)))


# -- the words -------------------------------------------------------------------------------
def test_any_block_of_the_grid_is_that_block_of_the_whole_grid():
    whole = words(99, (0, 10), (0, 12))
    assert torch.equal(words(99, (3, 4), (5, 6)), whole[3:7, 5:11])
    assert whole.dtype == torch.int64 and 0 <= int(whole.min()) and int(whole.max()) < 2 ** 32


def test_words_look_independent_and_uniform():
    """Bits fair, keep masks uncorrelated between neighbouring rows, columns and keys (each
    figure within 5 standard errors of 0 for 2M draws)."""
    w = words(123, (0, 512), (0, 4096))
    bits = torch.stack([(w >> k) & 1 for k in range(32)]).double().mean(dim=(1, 2))
    assert (bits - 0.5).abs().max() < 5 * 0.5 / math.sqrt(w.numel())
    keep = (w >= threshold(0.5)).double()
    other = (words(mix_seed(123, 1), (0, 512), (0, 4096)) >= threshold(0.5)).double()
    se = 5 / math.sqrt(w.numel())
    for a, b in ((keep[:-1], keep[1:]), (keep[:, :-1], keep[:, 1:]), (keep, other)):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < se
    for p in (0.1, 0.5, 0.9):
        assert abs(float((w < threshold(p)).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / w.numel())


# -- a layer's mask does not depend on how the batch is cut --------------------------------------
@pytest.mark.parametrize("kind,shape", LAYERS, ids=[k.__name__ for k, _ in LAYERS])
def test_chunks_drawn_at_their_rows_are_the_whole_batch_drawn_at_once(kind, shape):
    net = _net(kind)
    x = torch.randn(shape, dtype=torch.float64)
    with step_stream(3, 5, 0):
        whole = net(x)
    parts = []
    for first, n in ((0, 3), (3, 2), (5, 2)):  # 7 over 3 replicas
        with step_stream(3, 5, 0, first_row=first):
            parts.append(net(x[first:first + n]))
    assert torch.equal(torch.cat(parts), whole)
    with step_stream(3, 5, 0):  # rows 1-3 drawn as if they were rows 0-2: other masks
        assert not torch.equal(net(x[1:4]), whole[1:4])


def test_column_blocks_are_the_whole_rows_mask():
    """Hybrid's split head: blocks of features, one after the other in one thread
    (stream.blocks), then a block at its columns (stream.at, one per process)."""
    net = _net(nn.Dropout)
    x = torch.randn(7, 10, dtype=torch.float64)
    with step_stream(3, 5, 1):
        whole, second = net(x), net(x)
    with step_stream(3, 5, 1):
        out = []
        with stream.blocks() as block:
            for first, n in ((0, 4), (4, 3), (7, 3)):
                with block(first):
                    out.append(net(x[:, first:first + n]))
        assert torch.equal(torch.cat(out, 1), whole)
        assert torch.equal(net(x), second)  # the blocks counted as one call of the layer
    with step_stream(3, 5, 1, first_row=4):  # a rank whose own rows start at 4
        with stream.at(0, 4):
            assert torch.equal(net(x[:, 4:7]), whole[:, 4:7])


def test_each_call_step_micro_batch_and_layer_draws_another_mask():
    a, b = keyed_dropout(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)))
    x = torch.ones(6, 40)
    with step_stream(0, 0, 0):
        first, again, other = a(x), a(x), b(x)  # a second call of one layer: another mask
    draws = [first, again, other]
    for key in ((0, 1, 0), (0, 0, 1), (1, 0, 0)):
        with step_stream(*key):
            draws.append(a(x))
    with step_stream(0, 0, 0):
        assert torch.equal(a(x), first)  # the same key: the same mask
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j]), (i, j)


def test_replica_threads_count_their_own_calls():
    """stream.use gives a replica thread its own call counts: each replica runs the forward
    once, and its layer's first call is the first call of the forward."""
    net = _net(nn.Dropout)
    x = torch.ones(4, 8)
    with step_stream(1, 1, 0):
        place = stream.current()
        with stream.use(place):
            inside = net(x)
        with stream.use(place):
            assert torch.equal(net(x), inside)
        assert torch.equal(net(x), inside)  # the caller's counts were not moved


# -- the layers as torch's --------------------------------------------------------------------
@pytest.mark.parametrize("kind,shape", LAYERS, ids=[k.__name__ for k, _ in LAYERS])
def test_outside_a_stream_in_eval_and_at_p_0_or_1_they_are_torchs_layers(kind, shape):
    net = _net(kind, 0.3)
    x = torch.randn(shape)
    torch.manual_seed(5)
    mine = net(x)
    torch.manual_seed(5)
    assert torch.equal(mine, kind(0.3)(x))  # training, no stream: torch's generator
    with step_stream(0, 0, 0):
        assert torch.equal(net.eval()(x), x)
        for p in (0.0, 1.0):
            layer = _net(kind, p)
            assert torch.equal(layer(x), kind(p)(x))


def _formula(kind, x, keep, p):
    """Dropout of ``x`` given the mask ``keep`` (broadcast): kept values times 1/(1-p); alpha
    dropout's a * x + alpha * a * p where kept, alpha * a * (p - 1) where dropped (SELU's
    fixed point, as torch's alpha_dropout)."""
    keep = keep.double()
    if kind in (nn.AlphaDropout, nn.FeatureAlphaDropout):
        alpha = 1.7580993408473766
        a = 1 / math.sqrt((alpha ** 2 * p + 1) * (1 - p))
        return x * (keep * a) + (keep - 1) * alpha * a + alpha * a * p
    return x * keep / (1 - p)


@pytest.mark.parametrize("kind,shape", LAYERS, ids=[k.__name__ for k, _ in LAYERS])
def test_a_keyed_mask_goes_through_torchs_formula(kind, shape):
    """The formula is torch's (checked on torch's own output with its own mask, read back
    from the output), and the keyed layer's output is that formula of the keyed mask."""
    p = 0.3
    channel = kind not in (nn.Dropout, nn.AlphaDropout)
    keep_shape = (shape[0], shape[1]) + (1,) * (len(shape) - 2) if channel else shape
    x = torch.randn(shape, dtype=torch.float64)
    theirs = kind(p)(x)
    dropped = _formula(kind, torch.zeros(()), torch.zeros(()), p)  # a dropped value
    torch_keep = (theirs != dropped).flatten(2 if channel else 1)
    torch_keep = torch_keep[..., :1].view(keep_shape) if channel else torch_keep.view(shape)
    torch.testing.assert_close(theirs, _formula(kind, x, torch_keep, p), rtol=0, atol=1e-14)
    net = _net(kind, p)
    with step_stream(2, 7, 0):
        y = net(x)
    with step_stream(2, 7, 0):
        key = stream.current().draw(net[0].key_name)
    cols = shape[1] if channel else math.prod(shape[1:])
    keep = (words(key, (0, shape[0]), (0, cols)) >= threshold(p)).view(keep_shape)
    torch.testing.assert_close(y, _formula(kind, x, keep, p), rtol=0, atol=1e-14)
    assert 0.1 < float((~keep).double().mean()) < 0.6


def test_the_backward_is_the_mask_times_the_scale():
    net = _net(nn.Dropout, 0.25)
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    with step_stream(0, 3, 0):
        y = net(x)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).double() / 0.75)
    torch.autograd.gradcheck(lambda t: _keyed_once(net, t), (x.detach().requires_grad_(),))


def _keyed_once(net, t):
    with step_stream(0, 3, 0):
        return net(t)


def test_inplace_layers_write_their_input():
    net = keyed_dropout(nn.Sequential(nn.Dropout(0.5, inplace=True)))
    x = torch.ones(4, 50)
    with step_stream(0, 0, 0):
        y = net(x)
    assert y is x and 0 < float((x == 0).double().mean()) < 1


def test_unbatched_channel_inputs_are_one_sample():
    for layer, shape in ((nn.Dropout1d, (5, 6)), (nn.Dropout3d, (5, 2, 2, 2))):
        net = _net(layer)
        x = torch.ones(shape)
        with step_stream(0, 0, 0, first_row=2):
            one = net(x)
        with step_stream(0, 0, 0):
            batch = net(torch.ones((3, *shape)))
        assert torch.equal(one, batch[2])


# -- conversion --------------------------------------------------------------------------------
def test_keyed_dropout_converts_torchs_layers_in_place_and_names_them():
    shared = nn.Dropout(0.2)

    class Mine(nn.Dropout):  # a subclass may change forward: left alone
        pass

    model = nn.Sequential(nn.Linear(3, 3), shared, nn.Sequential(shared, nn.Dropout2d(0.1)),
                          Mine(0.4), DropPath(0.3)).eval()
    keys = list(model.state_dict())
    out = keyed_dropout(model)
    assert out is model and list(model.state_dict()) == keys
    assert type(model[1]) is KeyedDropout and model[2][0] is model[1]  # still shared
    assert type(model[2][1]) is KeyedDropout2d and type(model[3]) is Mine
    assert (model[1].p, model[1].inplace, model[1].training) == (0.2, False, False)
    assert [model[1].key_name, model[2][1].key_name, model[4].key_name] == ["1", "2.1", "4"]
    assert type(keyed_dropout(nn.AlphaDropout(0.1))) is KeyedAlphaDropout
    for torch_kind, mine in ((nn.Dropout1d, KeyedDropout1d), (nn.Dropout3d, KeyedDropout3d),
                             (nn.FeatureAlphaDropout, KeyedFeatureAlphaDropout)):
        assert isinstance(mine(0.1), torch_kind)
        assert type(keyed_dropout(torch_kind(0.1))) is mine


def test_an_unnamed_layer_in_a_stream_is_a_bug_said_so():
    with step_stream(0, 0, 0), pytest.raises(RuntimeError, match="no name"):
        KeyedDropout(0.5)(torch.ones(2, 2))


# -- drop path ---------------------------------------------------------------------------------
def test_drop_path_keeps_or_drops_each_sample_whole_scaled_by_keep():
    net = keyed_dropout(nn.Sequential(DropPath(0.5)))
    x = torch.ones(64, 3, 2, 2)
    with step_stream(0, 0, 0):
        y = net(x)
    per_sample = y.flatten(1)
    assert ((per_sample == 0).all(1) | (per_sample == 2).all(1)).all()
    assert 10 < int((per_sample[:, 0] == 0).sum()) < 54
    with step_stream(0, 0, 0, first_row=10):
        assert torch.equal(net(x[10:20]), y[10:20])
    torch.manual_seed(1)
    outside = net(x)  # torch's generator, as timm's DropPath
    assert ((outside.flatten(1) == 0).all(1) | (outside.flatten(1) == 2).all(1)).all()
    assert torch.equal(net.eval()(x), x)


def test_drop_path_rates_are_linear_over_depth_as_timms():
    assert drop_path_rates(0.1, 5) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])
    assert drop_path_rates(0.2, 1) == [0.2] and drop_path_rates(0.2, 0) == []


# -- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("kind,shape", [LAYERS[0], LAYERS[2]], ids=["Dropout", "Dropout2d"])
def test_on_cuda_the_masks_are_the_cpus_drawn_without_a_host_sync(kind, shape):
    """The words are integer tensor ops on the device: the same masks as on the CPU, and
    nothing waits for the device (torch's sync debug mode raises on a synchronising call)."""
    net = keyed_dropout(nn.Sequential(kind(0.5), DropPath(0.3)))
    x = torch.randn(shape, device="cuda", requires_grad=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with step_stream(3, 5, 0, first_row=2):
            y = net(x)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with step_stream(3, 5, 0, first_row=2):
        ref = net(x.detach().cpu())
    assert torch.equal(y.detach().cpu() == 0, ref == 0) and (ref == 0).any()
