"""Megatron's data samplers (data_samplers.py): the pretraining sampler that resumes at
`consumed_samples`, the collate into ((tokens, position_ids), labels) (packed documents: as their flags
make them), this rank's micro-batch iterator, and the train/valid/test dataset build from the flags."""
import functools

from .dist_utils import print_rank_0


class PretrainingSampler:
    """Megatron's MegatronPretrainingSampler: from `consumed_samples` on, consecutive global
    micro-steps of micro_batch x dp samples; this data-parallel rank takes its slice."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size):
        if consumed_samples >= total_samples:
            raise RuntimeError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self):
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def __iter__(self):
        step = self.mbs * self.dp_size
        for first in range(self.consumed, self.total - step + 1, step):
            begin = first + self.dp_rank * self.mbs
            yield list(range(begin, begin + self.mbs))


def _collate(samples, packing=None):
    """((tokens, position_ids), labels); with packed documents (`packing`, model/documents.Packing) their
    positions and labels as Megatron's document flags make them."""
    import numpy as np
    import torch
    from megatron_ds.model import position_ids_like  # lazy: torch, after the flags are checked
    text = torch.from_numpy(np.stack([s["text"] for s in samples]).astype(np.int64))
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    if packing is not None:
        return packing.batch(tokens, labels)
    return (tokens, position_ids_like(tokens)), labels


def _packing(args):
    """The run's document packing (None without the document flags), with the tokenizer's EOD token."""
    import dataclasses
    from megatron_ds.model.documents import Packing  # lazy: torch, after the flags are checked
    config = getattr(args, "gpt_config", None)
    if config is None or not config.packs_documents:
        return None
    return Packing(dataclasses.replace(config, eod_token=args.eod_token))


class MicroBatchIterator:
    """This rank's micro-batches ((tokens, position_ids), labels), opened lazily on the first
    next() so that ranks that never read (middle pipeline stages) pay nothing."""

    def __init__(self, dataset, consumed_samples, args, dp_rank):
        self.dataset, self.consumed, self.args, self.dp_rank = dataset, consumed_samples, args, dp_rank
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            import torch
            from torch.utils.data import DataLoader
            sampler = PretrainingSampler(len(self.dataset), self.consumed, self.args.micro_batch_size,
                                         self.dp_rank, self.args.data_parallel_size)
            loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.args.num_workers,
                                collate_fn=functools.partial(_collate, packing=_packing(self.args)),
                                persistent_workers=False,
                                generator=torch.Generator().manual_seed(self.args.seed))  # not the global RNG
            self._it = iter(loader)
        return next(self._it)


def build_datasets(args):
    from megatron_ds.data.gpt_dataset import build_train_valid_test_datasets  # lazy: torch, after the flags are checked
    gbs = args.global_batch_size
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    sizes = [args.train_samples, eval_iters * gbs, args.eval_iters * gbs]
    print_rank_0(f"> building train, validation, and test datasets ...\n"
                 f"    datasets target sizes (minimum size):\n    train:      {sizes[0]}\n"
                 f"    validation: {sizes[1]}\n    test:       {sizes[2]}")
    return build_train_valid_test_datasets(
        data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
        train_valid_test_num_samples=sizes, seq_length=args.seq_length, seed=args.seed,
        skip_warmup=not args.mmap_warmup, data_cache_path=args.data_cache_path)
