"""Global batch size over training: constant, or Megatron's linear ramp-up.

--rampup-batch-size START INCREMENT SAMPLES: the global batch starts at START
and grows by INCREMENT every SAMPLES / ((GBS - START) / INCREMENT) consumed
samples; once more than SAMPLES samples are consumed it is GBS. The batch of an
iteration depends only on the samples consumed before it, so a resumed run
follows the same ramp.

The pipeline engine fixes its gradient-accumulation steps at start-up; the
training loop applies each new size with engine.set_train_batch_size(), which
changes the number of micro-batches of the next train_batch (as
Megatron-DeepSpeed does). The micro-batch size never changes.
"""


class BatchSizeSchedule:

    def __init__(self, global_batch_size, rampup=None):
        self.final = global_batch_size
        self.rampup = rampup
        if rampup is not None:
            start, increment, samples = rampup
            self.start, self.increment, self.rampup_samples = start, increment, samples
            increments = (global_batch_size - start) // increment
            self.samples_per_increment = samples / increments if increments else None

    def global_batch_size(self, consumed_samples):
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if self.rampup is None or self.samples_per_increment is None or consumed_samples > self.rampup_samples:
            return self.final
        steps = int(consumed_samples / self.samples_per_increment)
        return min(self.final, self.start + steps * self.increment)

    def samples_after(self, iterations):
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch_size(consumed)
        return consumed

    def iterations_for(self, train_samples):
        """Megatron's update_train_iters: the ramp-up iterations, then whole final batches."""
        if self.rampup is None:
            return train_samples // self.final
        iterations = consumed = 0
        while consumed <= self.rampup_samples and consumed < train_samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.final
