"""The run's saves, synchronous or in the background (--async-save), each committed only when whole.

Synchronous: save_load.save_checkpoint writes and commits in the saving iteration. In the background: the
saving iteration stops only for save_load.write_step with a Collector (the host copies, into buffers reused
from one save to the next: async_save.HostBuffers), then a thread of each rank writes the files
(async_save.Job). At most one save is in flight. The step is committed at an
iteration boundary on the training thread: `poll` (every boundary while a save is in flight) asks every
rank whether its writer is done (one all-reduce), and once all are, every rank commits together
(save_load.commit_step: the disk-full agreement, the manifest from the writers' entries, `latest` by rank 0).
The next save, and the run's end (a clean exit, --exit-interval, a signal, the kill switch, a NaN stop),
`wait` for it first and say how long they waited. A rank that dies while writers write leaves `latest` at
the previous committed step. After each commit rank 0 applies --keep-last-checkpoints (retention.py), and
every save logs what it cost (save_stats.py).
"""
import os
import time

from megatron_ds.data.dist_utils import print_rank_0

from . import engine as checkpoint_engine, retention, save_stats
from .async_save import HostBuffers, Job
from .save_load import commit_step, save_checkpoint, write_step


def _all_ranks(flag):
    """True when `flag` holds on every rank (an all-reduce MIN, on the device nccl needs)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _gather(item):
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


class Saves:
    """Owned by the Trainer: `save` (at the cadence's iterations), `poll` (every iteration boundary),
    `wait` (before the run ends). `tb`: the run's TensorBoard (checkpoint/* scalars)."""

    def __init__(self, args, tb=None, loaded_tag=None):
        self.args, self.tb = args, tb
        self.pending = None  # (iteration, Job, blocking seconds)
        self.buffers = None  # the host copies' memory, kept from one background save to the next
        self.probed, self.probe_mbs = False, None  # the plain sequential write's MB/s, once measured
        self.refused = None  # the last iteration whose commit found no room (--keep-training-on-disk-full)
        same = args.load and args.save and os.path.realpath(args.load) == os.path.realpath(args.save)
        match = retention.STEP.match(loaded_tag or "") if same else None
        self.protected = {int(match.group(1))} if match else set()

    def save(self, engine, args, iteration, consumed_train, consumed_valid, extra_files=()):
        """Save `iteration` (`args`: the run's settings now, "auto" may have replaced them). Returns True/False
        (committed or not, synchronous), None (in the background)."""
        import torch.distributed as dist
        self.wait(f"before the save of iteration {iteration}")
        self.args = args
        rank = dist.get_rank()
        probe = None
        if not self.probed:
            self.probed = True
            os.makedirs(self.args.save, exist_ok=True)
            probe = lambda: save_stats.probe(self.args.save, self.args.save_write_probe_mib, rank)  # noqa: E731
        if not self.args.async_save:
            self.probe_mbs = probe() if probe else self.probe_mbs
            checkpoint_engine.written.clear()
            start = time.perf_counter()
            committed = save_checkpoint(engine, self.args, iteration, consumed_train, consumed_valid, extra_files)
            blocking = time.perf_counter() - start
            files = checkpoint_engine.written
            record = save_stats.rank_record(rank, sum(b for _, _, b in files), sum(s for _, s, _ in files), 0,
                                             self.probe_mbs)
            self._report(iteration, blocking, _gather(record), committed, background=False)
            return committed
        start = time.perf_counter()
        if self.buffers is None:
            self.buffers = HostBuffers(pin=_on_cuda())
        pin = self.buffers.pin
        collector = checkpoint_engine.Collector(checkpoint_engine.install(engine), self.buffers.copier())
        try:
            step_dir = write_step(engine, self.args, iteration, consumed_train, consumed_valid, extra_files,
                                  collector)
        except BaseException:
            self.buffers.release()  # no writer will
            raise
        if pin:  # the copies are whole before the next step's kernels (on any stream) may change a state
            import torch
            torch.cuda.synchronize()
        job = Job(iteration, step_dir, collector, rank, probe=probe, buffers=self.buffers).start()
        self.pending = (iteration, job, time.perf_counter() - start)
        return None

    def poll(self):
        """At an iteration boundary: commit the save in flight if every rank's writer is done."""
        if self.pending and _all_ranks(self.pending[1].done()):
            self._commit()

    def wait(self, why):
        """Block until the save in flight is written and committed (nothing in flight: returns at once)."""
        if not self.pending:
            return
        iteration, job, _ = self.pending
        start = time.perf_counter()
        job.join()
        self._commit()
        print_rank_0(f"  waited {time.perf_counter() - start:.2f} s for the background save of iteration "
                     f"{iteration} ({why})")

    def _commit(self):
        iteration, job, blocking = self.pending
        self.pending = None
        errors = _gather(None if job.error is None else f"rank {job.rank}: {type(job.error).__name__}: {job.error}")
        if job.error is not None:
            raise job.error
        if any(errors):  # every rank stops, not only the one whose writer failed
            raise RuntimeError(f"the background save of iteration {iteration} failed: {next(e for e in errors if e)}")
        known = {}
        for entries in _gather(job.entries):
            known.update(entries)
        committed = commit_step(self.args, iteration, known)
        if not committed:
            self.refused = iteration
        self.probe_mbs = job.probe if job.probe is not None else self.probe_mbs
        record = save_stats.rank_record(job.rank, job.bytes, job.seconds, job.host_bytes, self.probe_mbs)
        self._report(iteration, blocking, _gather(record), committed, background=True)

    def _report(self, iteration, blocking, records, committed, background):
        import torch.distributed as dist
        if not committed:
            return
        if dist.get_rank() == 0 and self.args.keep_last_checkpoints:
            retention.prune(self.args.save, iteration, self.args.keep_last_checkpoints, self.args.keep_every,
                            self.protected)
        print_rank_0("  " + save_stats.line(iteration, blocking, records, background))
        if self.tb is not None:
            save_stats.to_tensorboard(self.tb, iteration, blocking, records)


def _on_cuda():
    import torch
    return torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"

