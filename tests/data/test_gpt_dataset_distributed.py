"""Two gloo ranks: rank 0 builds the index cache, rank 1 waits and loads it; a rank-0 failure hangs nobody."""
import os
import time

import numpy as np
import torch.multiprocessing as mp

from megatron_ds.data import gpt_dataset


def _rank_main(rank, tmp, prefix, results):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    real_build = gpt_dataset._build_and_save

    def slow_build(*args, **kwargs):
        time.sleep(1.0)  # rank 1 must really wait for this, not find half-written files
        real_build(*args, **kwargs)

    def no_build(*args, **kwargs):
        raise AssertionError(f"rank {rank} built the index")

    def failing_build(*args, **kwargs):
        raise RuntimeError("disk full")

    gpt_dataset._build_and_save = slow_build if rank == 0 else no_build
    train, _, _ = gpt_dataset.build_train_valid_test_datasets([prefix], "mmap", "1,0,0", [40, 0, 0], 8, 3, True)
    samples = [train[i]["text"].tolist() for i in range(40)]

    gpt_dataset._build_and_save = failing_build if rank == 0 else no_build
    try:
        gpt_dataset.build_train_valid_test_datasets([prefix], "mmap", "1,0,0", [41, 0, 0], 8, 3, True)
        failure = None
    except Exception as e:  # noqa: BLE001 - the message is what we check
        failure = str(e)
    dist.destroy_process_group()
    results.put((rank, samples, failure))


def test_rank_0_builds_and_the_other_rank_waits(tmp_path):
    from .test_gpt_dataset import random_docs, write_docs
    prefix = write_docs(str(tmp_path / "dist"), random_docs(3, 30))
    ctx = mp.get_context("fork")  # children inherit the imported torch: seconds faster than spawn
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path), prefix, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (s, f)) for r, s, f in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[0][0] == got[1][0] and len(got[0][0]) == 40
    assert all(len(s) == 9 for s in got[0][0])
    assert got[0][1] == "disk full"
    assert "was not built (see rank 0's error)" in got[1][1]
    assert not any(n.endswith(".npy") and "_41ns_" in n for n in os.listdir(tmp_path))
    sizes = gpt_dataset.make_indexed_dataset(prefix).sizes
    documents = np.arange(30, dtype=np.int32)
    assert np.load(gpt_dataset.index_cache_paths("train", prefix, documents, sizes, 40, 8, 3)[2]).dtype == np.uint32
