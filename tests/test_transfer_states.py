"""Transfer states (issue 16): every send has an id and a Landing tied to it; a destination whose latest send
failed, was aborted or was superseded is refused by every read path, naming the send and the missing layers;
each layer is signalled exactly once; a pool's blocks belong to one live sequence at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab import models, steps
from kvlab.hooks import LayerHooks
from kvlab.kvcache import KVBuffer, layout_for
from kvlab.paged import BlockAllocator, BlockPool, BlockTable, PoolSpec, prefill_into_pages
from kvlab.paged.registry import make_transport
from kvlab.landing import TransferError
from kvlab.transfer import Transport


@pytest.fixture(scope="module")
def tiny():
    return models.build("kvlab-tiny", device="cpu", dtype=torch.float32, seed=0)


def _src(tiny, tokens=16):
    ids = steps.make_prompt(tiny.config.vocab_size, tokens, "cpu")
    lay = layout_for(tiny, tokens, dtype=torch.float32)
    src = KVBuffer(lay)
    first = steps.prefill(tiny, ids, src).argmax(-1)
    return ids, lay, src, first


def test_a_new_destination_is_poisoned_and_unreadable(tiny):
    _, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    assert t.buffer.count_poison() == t.buffer.data.numel()
    with pytest.raises(TransferError, match="nothing has been sent to same-device yet"):
        steps.decode(tiny, t.buffer, first, 2)


def test_ctrl_c_inside_a_layer_wise_send_leaves_a_destination_nothing_decodes(tiny):
    """The reported case: Ctrl-C inside layer 1's send, then decode gave tokens [0, 0, 0, 0] and NaN logits."""
    ids, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    good = t.send(src)  # an earlier request landed: its bytes are in the destination
    t.receive(good)
    sender = t.layerwise(src)

    def on_kv(i):
        sender.on_layer(i)
        if i == 0:
            raise KeyboardInterrupt

    hooks = LayerHooks(tiny, on_kv, ranges=False)
    sender.begin()
    with pytest.raises(KeyboardInterrupt), hooks:
        steps.prefill_or_abort(tiny, ids, src, sender, hooks)
    landing = sender._landing
    assert landing.state == "aborted" and landing.send_id == 2
    with pytest.raises(TransferError, match=r"send 2 to same-device aborted .*layers \[1\] of 2"):
        steps.decode(tiny, t.buffer, first, 4)
    with pytest.raises(TransferError, match="aborted"):
        t.receive(landing)
    with pytest.raises(TransferError, match="send 1 to same-device is not the latest"):
        t.receive(good)  # the earlier request's landing cannot vouch for a destination a later send touched
    # a new send that lands makes it readable again
    again = t.send(src)
    got = t.receive(again)
    toks, _ = steps.decode(tiny, got, first, 4)
    ref, _ = steps.decode(tiny, src, first, 4)
    assert torch.equal(toks, ref)


def test_a_layer_wise_send_that_misses_a_layer_fails_and_names_it(tiny):
    ids, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    sender = t.layerwise(src)
    sender.begin()
    sender.on_layer(1)
    with pytest.raises(RuntimeError, match=r"saw 1 of 2 layers \(missing \[0\]\)"):
        sender.finish()
    assert sender._landing.state == "failed"
    with pytest.raises(TransferError, match=r"send 1 to same-device failed .*layers \[0\] of 2"):
        steps.decode(tiny, t.buffer, first, 2)


@pytest.mark.parametrize("bad, says", [(-1, "out of range"), (2, "out of range"), (0.0, "not a layer index"),
                                       (True, "not a layer index"), (0, "signalled twice"),
                                       (np.int64(0), "signalled twice")])
def test_each_layer_is_signalled_exactly_once(tiny, bad, says):
    _, lay, src, _ = _src(tiny)
    sender = Transport(lay, "same-gpu", "cpu").layerwise(src)
    sender.begin()
    sender.on_layer(0)
    with pytest.raises(ValueError, match=says):
        sender.on_layer(bad)


def test_waiting_on_a_layer_wise_send_before_finish_is_refused(tiny):
    """Found in an audit: wait() between begin() and finish() returned at once and marked the send waited, so
    receive() and decode read a destination whose layer 1 had never been signalled (NaN)."""
    _, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    sender = t.layerwise(src).begin()
    sender.on_layer(0)
    landing = t.latest
    assert landing.landed(0) and not landing.landed(1) and landing.state == "in-flight"
    for call in (landing.wait, lambda: landing.stream_wait(None), lambda: t.receive(landing)):
        with pytest.raises(TransferError, match=r"send 1 to same-device is still being sent: layers \[1\] of 2"):
            call()
    with pytest.raises(TransferError, match="in flight"):
        steps.decode(tiny, t.buffer, first, 1)
    sender.on_layer(1)
    got = t.receive(sender.finish())
    assert got.count_poison() == 0


def test_a_superseded_landing_is_refused(tiny):
    _, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    first_send, second_send = t.send(src), t.send(src)
    assert (first_send.send_id, second_send.send_id) == (1, 2)
    with pytest.raises(TransferError, match="send 1 .* is not the latest"):
        t.receive(first_send)
    assert t.receive(second_send) is t.buffer


# ------------------------------------------------------------------------------------------------- paged


def _paged(tiny, tokens=20, bs=4):
    lay = layout_for(tiny, tokens, dtype=torch.float32)
    spec = PoolSpec.from_kv_layout(lay, bs)
    n = spec.blocks_for(tokens)
    pool = BlockPool(spec, 2 * n).poison()
    table = BlockAllocator(2 * n, bs, seed=1).allocate(tokens)
    ids = steps.make_prompt(tiny.config.vocab_size, tokens, "cpu")
    return ids, spec, n, pool, table


def test_a_paged_destination_of_an_aborted_send_is_unreadable(tiny):
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    dst = BlockAllocator(2 * n, spec.block_size, seed=2).allocate(table.tokens)
    prefill_into_pages(tiny, ids, pool, table)
    ok = t.send(pool, table, dst)
    assert ok.state == "landed" and t.pool.read(dst) is not None
    sender = t.layerwise(pool, table, dst)
    sender.begin()
    sender.on_layer(0)
    sender.abort("Ctrl-C")
    with pytest.raises(TransferError, match=r"aborted \(Ctrl-C\): layers \[1\]"):
        t.pool.read(dst)
    with pytest.raises(TransferError, match="aborted"):
        t.pool.to_hf_cache(dst)
    t.send(pool, table, dst)
    assert t.pool.read(dst).count_poison() == 0


def test_waiting_on_a_paged_layer_wise_send_before_finish_is_refused(tiny):
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    dst = BlockAllocator(2 * n, spec.block_size, seed=2).allocate(table.tokens)
    prefill_into_pages(tiny, ids, pool, table)
    sender = t.layerwise(pool, table, dst)
    sender.begin()
    sender.on_layer(0)
    with pytest.raises(TransferError, match=r"is still being sent: layers \[1\] of 2"):
        sender._landing.wait()
    with pytest.raises(TransferError, match="in flight"):
        t.pool.read(dst)
    sender.on_layer(1)
    sender.finish().wait()
    assert t.pool.read(dst).count_poison() == 0


def test_a_pool_refuses_blocks_another_live_sequence_holds(tiny):
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    b = BlockTable(list(range(1, n + 1)), table.tokens, spec.block_size)  # overlaps a's blocks 1 … n-1
    prefill_into_pages(tiny, ids, pool, table)
    t.send(pool, table, a)
    with pytest.raises(ValueError, match=rf"\({n - 1} of {n}\) hold another live sequence"):
        t.send(pool, table, b)
    t.pool.release(a)
    t.send(pool, table, b)  # a's sequence is done: its blocks may be reused
    assert t.pool.read(b).count_poison() == 0


def test_a_dropped_table_frees_its_blocks_even_while_a_plan_is_cached(tiny):
    """Each request allocates its table afresh (the same blocks each time) and drops the last one: the transport's
    cached plan must not keep the dropped table's claim alive."""
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    for _ in range(3):
        dst = BlockAllocator(2 * n, spec.block_size, seed=2).allocate(table.tokens)
        t.send(pool, table, dst)
        assert t.pool.read(dst).count_poison() == 0


def test_a_read_checks_every_block_against_the_send_that_last_wrote_it(tiny):
    """An older aborted send into some of a table's blocks is not hidden by a newer send into others."""
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    sender = t.layerwise(pool, table, a)
    sender.begin()
    sender.abort("Ctrl-C")
    t.pool.release(a)
    b = BlockTable(list(range(n, 2 * n)), table.tokens, spec.block_size)
    t.send(pool, table, b)  # lands in other blocks
    mixed = BlockTable([0] + list(range(n + 1, 2 * n)), table.tokens, spec.block_size)
    with pytest.raises(TransferError, match="aborted"):
        t.pool.read(mixed)


def test_a_cached_plan_cannot_write_blocks_another_sequence_took(tiny):
    """Found in review: send to a, release a, send to b (overlapping a), then send to a again through its cached
    plan — that last send would overwrite b's live blocks."""
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    b = BlockTable(list(range(1, n + 1)), table.tokens, spec.block_size)
    t.send(pool, table, a)
    t.pool.release(a)
    t.send(pool, table, b)
    with pytest.raises(ValueError, match="hold another live sequence"):
        t.send(pool, table, a)


def test_two_live_tables_with_the_same_blocks_are_two_sequences(tiny):
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    twin = BlockTable(list(range(n)), table.tokens, spec.block_size)
    t.send(pool, table, a)
    with pytest.raises(ValueError, match="hold another live sequence"):
        t.send(pool, table, twin)


def test_a_packed_send_or_a_write_cannot_overwrite_a_live_sequence(tiny):
    """Found in an audit: only a send with a destination table checked ownership; a packed send (blocks 0 … n-1)
    and pool.write overwrote a live sequence's blocks."""
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    t.send(pool, table, a)
    with pytest.raises(ValueError, match=rf"a packed send of {n} blocks .* would overwrite blocks .*\({n} of {n}\)"):
        t.send(pool, table)
    other = BlockTable(list(range(1, n + 1)), table.tokens, spec.block_size)
    with pytest.raises(ValueError, match="hold another live sequence"):
        t.pool.write(pool.read(table), other)
    with pytest.raises(ValueError, match="hold another live sequence"):
        prefill_into_pages(tiny, ids, t.pool, other)
    assert t.pool.read(a).count_poison() == 0  # a is intact
    t.pool.release(a)
    t.send(pool, table)  # a's sequence is done: a packed send may use its blocks
    assert t.pool.read(BlockTable.packed(table.tokens, spec.block_size)).count_poison() == 0


def test_blocks_no_send_reached_are_refused(tiny):
    """Found in an audit: reading a transport's pool where nothing was sent returned poison without a word."""
    ids, spec, n, pool, table = _paged(tiny)
    t = make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu")
    prefill_into_pages(tiny, ids, pool, table)
    a = BlockTable(list(range(n)), table.tokens, spec.block_size)
    elsewhere = BlockTable(list(range(n, 2 * n)), table.tokens, spec.block_size)
    with pytest.raises(TransferError, match=rf"blocks .* \({n} of {n}\) have not been written"):
        t.pool.read(a)
    t.send(pool, table, a)
    with pytest.raises(TransferError, match="have not been written"):
        t.pool.to_hf_cache(elsewhere)
    assert t.pool.read(a).count_poison() == 0
    t.poison()  # poisoned: what was sent is gone
    with pytest.raises(TransferError, match="have not been written since the pool was made or poisoned"):
        t.pool.read(a)


def test_a_poisoned_destination_is_unreadable_until_the_next_send(tiny):
    """Found in an audit: send, poison(), decode gave tokens [0, 0] from NaN without an error."""
    _, lay, src, first = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    landing = t.send(src)
    t.poison()
    with pytest.raises(TransferError, match="nothing has been sent to same-device since it was poisoned"):
        steps.decode(tiny, t.buffer, first, 2)
    with pytest.raises(TransferError, match="not the latest"):
        t.receive(landing)
    t.receive(t.send(src))
    steps.decode(tiny, t.buffer, first, 2)


def test_receive_names_what_it_takes(tiny):
    _, lay, src, _ = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    t.send(src)
    with pytest.raises(TypeError, match=r"expected the Landing that send\(\) returned, got 'cpu' \(str\)"):
        t.receive("cpu")


def test_a_numpy_layer_index_is_a_layer_index(tiny):
    """Found in an audit: on_layer(np.int64(0)) was refused as "out of range"."""
    _, lay, src, _ = _src(tiny)
    t = Transport(lay, "same-gpu", "cpu")
    sender = t.layerwise(src).begin()
    for i in np.arange(lay.layers):
        sender.on_layer(i)
    assert t.receive(sender.finish()).count_poison() == 0


def test_signalling_before_begin_says_so(tiny):
    ids, spec, n, pool, table = _paged(tiny)
    _, lay, src, _ = _src(tiny)
    for sender in (Transport(lay, "same-gpu", "cpu").layerwise(src),
                   make_transport("torch-index", spec, "same-gpu", 2 * n, "cpu").layerwise(pool, table)):
        with pytest.raises(RuntimeError, match=r"on_layer\(\) before begin\(\)"):
            sender.on_layer(0)
        with pytest.raises(RuntimeError, match=r"finish\(\) before begin\(\)"):
            sender.finish()


@pytest.mark.gpu
def test_a_reused_event_of_an_earlier_send_does_not_make_a_layer_landed():
    """On a GPU a layer-wise send reuses its per-layer events: while the next send is being issued, layer 1's event
    still holds the earlier send's (completed) record. That layer is not landed until it is signalled again."""
    from kvlab.kvcache import KVLayout

    lay = KVLayout(layers=3, batch=1, kv_heads=2, tokens=64, head_dim=64, dtype=torch.bfloat16)
    src = KVBuffer(lay, device="cuda")
    src.data.normal_()
    t = Transport(lay, "same-gpu", "cuda")
    sender = t.layerwise(src, mode="event")
    sender.begin()
    for i in range(lay.layers):
        sender.on_layer(i)
    sender.finish().wait()
    sender.begin()
    sender.on_layer(0)
    torch.cuda.synchronize()
    landing = t.latest
    assert landing.landed(0) and not landing.landed(1) and landing.state == "in-flight"
    with pytest.raises(TransferError, match=r"still being sent: layers \[1, 2\] of 3"):
        landing.wait()
    for i in (1, 2):
        sender.on_layer(i)
    assert torch.equal(t.receive(sender.finish()).data, src.data)
