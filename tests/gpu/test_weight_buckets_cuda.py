"""Weight buckets through CUDA IPC: another process on the GPU reads every tensor, big ones in row ranges, exactly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run through the device tool)")


def _reader(requests, replies) -> None:
    import traceback

    from agentrl.weight_buckets import BucketMeta, unpack

    got: dict[str, torch.Tensor] = {}
    try:
        while (message := requests.get()) is not None:
            for part, view in unpack(BucketMeta.from_dict(message)):
                if part.rows is None:
                    got[part.name] = view.cpu()
                else:
                    full = got.setdefault(part.name, torch.empty(part.full_rows, *part.shape[1:], dtype=view.dtype))
                    full[part.rows[0]:part.rows[1]] = view.cpu()
            replies.put(message["index"])
        # numpy, not tensors: a CPU tensor would travel as a file descriptor that dies with this process
        replies.put({name: t.float().numpy() for name, t in got.items()})
    except Exception:
        replies.put(traceback.format_exc())


def _reply(replies):
    reply = replies.get(timeout=60)
    assert not isinstance(reply, str), reply  # the reader's traceback
    return reply


def test_a_second_process_reads_the_buckets_exactly():
    import torch.multiprocessing as mp

    from agentrl.weight_buckets import BucketRing, split_into_buckets

    g = torch.Generator(device="cuda").manual_seed(0)
    named = [("embed", torch.randn(300, 64, device="cuda", generator=g)),
             ("w", torch.randn(64, 64, device="cuda", generator=g)), ("b", torch.randn(7, device="cuda", generator=g))]
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(requests, replies))
    reader.start()
    with BucketRing.create("cuda_ipc", 32 << 10) as ring:  # 32 KiB: the 75 KiB embedding goes in row ranges
        for entries in split_into_buckets(named, ring.capacity, dtype=torch.bfloat16):
            meta = ring.pack(entries, dtype=torch.bfloat16)
            requests.put(meta.to_dict())
            ring.reuse(meta.index, lambda: _reply(replies))
        ring.drain()
        requests.put(None)
        got = _reply(replies)
    reader.join(timeout=60)
    assert set(got) == {n for n, _ in named}
    for name, tensor in named:
        assert torch.equal(torch.from_numpy(got[name]), tensor.to(torch.bfloat16).float().cpu()), name
