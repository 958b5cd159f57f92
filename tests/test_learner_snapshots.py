"""SnapshotBuffers: host memory for adapter snapshots, handed out again only once nothing holds it."""

from __future__ import annotations

import gc

import torch

from polytinker.engine.learner.snapshots import SnapshotBuffers


def test_a_released_buffer_is_reused_and_a_held_one_never_is() -> None:
    pool = SnapshotBuffers(keep=4)
    kinds = {
        "the tensor": lambda t: t,
        "a view": lambda t: t[10:20].view(2, 5),
        "an unbound row": lambda t: t.view(10, 100).unbind(0)[3],
        "an exported buffer": lambda t: memoryview(t.numpy()),
    }
    for kind, hold in kinds.items():
        snapshot = pool.take(1000, torch.float32)
        ptr = snapshot.data_ptr()
        assert ptr % 64 == 0 and snapshot.shape == (1000,) and snapshot.dtype == torch.float32
        holder = hold(snapshot)
        del snapshot
        gc.collect()
        assert pool.in_use() == 1, kind
        assert pool.take(1000, torch.float32).data_ptr() != ptr, f"{kind} holds it: it must not be reused"
        del holder
        assert pool.in_use() == 0, kind
        assert pool.take(1000, torch.float32).data_ptr() == ptr, kind  # released: the same memory again


def test_buffers_match_by_bytes_and_dtype_views_them() -> None:
    pool = SnapshotBuffers()
    ptr = pool.take(8, torch.float32).data_ptr()  # released at once
    half = pool.take(16, torch.bfloat16)  # the same 32 bytes
    assert half.data_ptr() == ptr and half.shape == (16,) and half.dtype == torch.bfloat16
    other = pool.take(9, torch.float32)
    assert other.data_ptr() != ptr


def test_the_pool_drops_free_buffers_beyond_keep_but_never_one_in_use() -> None:
    pool = SnapshotBuffers(keep=2)
    held = [pool.take(100 + i, torch.float32) for i in range(3)]  # three in use: all kept
    assert pool.in_use() == 3
    ptrs = {t.data_ptr() for t in held}
    extra = pool.take(50, torch.float32)
    assert extra.data_ptr() not in ptrs and len({t.data_ptr() for t in held}) == 3
    held.clear()
    del extra
    pool.take(7, torch.float32)  # a new size: the free ones beyond keep go first
    assert len(pool._arrays) <= 2 and pool.in_use() == 0
