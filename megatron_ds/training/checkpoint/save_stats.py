"""What a save cost: the time training stopped, the background write's time, bytes and bytes/s per rank,
against a plain sequential write to the same folder measured once a run (`probe`).

The probe: each rank writes --save-write-probe-mib MiB of zeros to SAVE/.write-probe-rankR in 8 MiB blocks,
fsyncs, and deletes it, at the run's first save (on the writer thread under --async-save, so that it meets
the same load as the save's files). A checkpoint far below it spends its time outside the disk: pickling,
many small files, the CRC-32s.
"""
import os
import time

MIB = 1 << 20
BLOCK = 8 * MIB


def probe(folder, mib, rank):
    """MB/s of one fsynced sequential write of `mib` MiB into `folder` (None when mib is 0 or it failed)."""
    if not mib:
        return None
    path = os.path.join(folder, f".write-probe-rank{rank}")
    block = bytes(BLOCK)
    left = mib * MIB
    start = time.perf_counter()
    try:
        with open(path, "wb") as f:
            while left > 0:
                left -= f.write(block[:min(left, BLOCK)])
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    except OSError:
        return None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return mib * MIB / 1e6 / max(seconds, 1e-9)


def rank_record(rank, written_bytes, write_seconds, host_bytes, probe_mbs):
    return {"rank": rank, "bytes": written_bytes, "seconds": write_seconds, "host_bytes": host_bytes,
            "probe": probe_mbs}


def rate(record):
    return record["bytes"] / 1e6 / record["seconds"] if record["seconds"] > 0 else 0.0


def line(iteration, blocking, records, background):
    """The save's one log line from every rank's record (rank order)."""
    parts = []
    for r in records:
        part = f"{r['rank']}: {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s = {rate(r):.1f} MB/s"
        if r["probe"]:
            part += f" ({rate(r) / r['probe']:.2f}x the plain sequential write's {r['probe']:.1f} MB/s)"
        parts.append(part)
    host = sum(r["host_bytes"] for r in records)
    how = (f"training stopped {blocking:.3f} s to copy {host / 1e6:.1f} MB to host memory, written in the "
           "background" if background else f"training stopped {blocking:.3f} s, written in it")
    return f"checkpoint at iteration {iteration}: {how}; per rank {'; '.join(parts)}"


def to_tensorboard(tb, iteration, blocking, records):
    """checkpoint/* scalars at the saved iteration (the last rank writes them)."""
    tb.scalar("checkpoint/blocking-time", blocking, iteration)
    tb.scalar("checkpoint/write-time", max(r["seconds"] for r in records), iteration)
    tb.scalar("checkpoint/bytes", sum(r["bytes"] for r in records), iteration)
    for r in records:
        tb.scalar(f"checkpoint/write-MBps/rank{r['rank']}", rate(r), iteration)
        if r["probe"]:
            tb.scalar(f"checkpoint/write-over-sequential/rank{r['rank']}", rate(r) / r["probe"], iteration)
