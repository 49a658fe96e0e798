"""The messages of vocabulary parallelism (pure data, no torch): who sends what to whom.

The dependencies of the vocabulary passes (schedules/deps.py) cross ranks, and each crossing is a
point-to-point message in the engine's MessagePlan, like an activation's. The paper's reduce,
broadcasts and all-reduce would be collectives, which every rank must enter in one order; the ranks
of a schedule run their ops in different orders, so the runtime sends the same data rank to rank
instead (per-pair FIFO, posted in the sender's order: messages.py). Per micro-batch (and segment):
- EF on rank j: its rows of the lookup (EMB) to stage 0's rank, which sums every slice's;
- the loss stage's F: its output X (HID) to every rank, for S and T;
- S on rank j: its statistics (STAT: max, sum of exp, target's logit per token) to every rank
  (each T, and the loss), and its input-gradient share (SHARE) to the loss stage's rank;
- stage 0's backward: the embedding output's gradient (EGRAD) to every rank, for EW.
Evaluation runs EF, F and S only: S then sends its statistics to the loss stage's rank alone.
A message a rank sends itself is a local hand-over. With TP each TP rank runs this plan with its peers
of the same TP rank (each message is its pipeline rank's block, summed over TP inside the passes).
"""
from megatron_ds.schedules.kinds import EF, EW, F, GRAD, S, T

EMB, HID, STAT, SHARE, EGRAD = "emb", "hid", "stat", "share", "egrad"
FLOAT32 = (STAT, SHARE)  # softmax statistics travel in fp32 whatever the model's dtype


def vocab_outgoing(schedule, op, train: bool) -> list:
    """[(message key, destination rank)] that `op` sends for the vocabulary passes, in send order,
    including those to its own rank. A key is (what, replica, stage or slice, mb, seq)."""
    rep, stage, mb, seq = op.unit
    ranks = range(schedule.pp)
    loss_rank = schedule.rank_of(rep, schedule.loss_stage)
    if op.kind is EF:
        return [((EMB, rep, stage, mb, seq), schedule.rank_of(rep, 0))]
    if op.kind is F and stage == schedule.loss_stage:
        return [((HID, rep, stage, mb, seq), r) for r in ranks]
    if op.kind is S:
        if not train:
            return [((STAT, rep, stage, mb, seq), loss_rank)]
        stats = [((STAT, rep, stage, mb, seq), r) for r in ranks]
        return stats + [((SHARE, rep, stage, mb, seq), loss_rank)]
    if train and op.kind.traits.sends == GRAD and stage == 0:
        return [((EGRAD, rep, 0, mb, seq), r) for r in ranks]
    return []


def vocab_incoming(schedule, op) -> list:
    """The vocabulary message keys `op` reads (some of them its own rank's), as pipe/vocab/vocab_passes.py
    reads them: for posting their receives ahead (messages.lookahead)."""
    rep, stage, mb, seq = op.unit
    slices = range(schedule.pp)
    if op.kind is F and stage == 0:
        return [(EMB, rep, j, mb, seq) for j in slices]
    if op.kind is S:
        return [(HID, rep, schedule.loss_stage, mb, seq)]
    if op.kind is T:
        return [(STAT, rep, j, mb, seq) for j in slices]
    if op.kind.traits.consumes == GRAD and stage == schedule.loss_stage:
        return [(what, rep, j, mb, seq) for what in (STAT, SHARE) for j in slices]
    if op.kind is EW:
        return [(EGRAD, rep, 0, mb, seq)]
    return []


def key(what: str, op, stage: int) -> tuple:
    """The key of message `what` about `op`'s micro-batch (and segment) from stage or slice `stage`."""
    return (what, op.replica, stage, op.mb, op.seq)


def token_shards(message_key: tuple, shards: int) -> int:
    """How many ways a message's tokens are cut under sequence parallelism: STAT is whole (the block's
    statistics, the same on each TP rank, which T and the loss read for every token); the others are
    this TP rank's shard, as the activations between stages."""
    return 1 if message_key[0] == STAT else shards


def width(message_key: tuple, hidden: int) -> int:
    """The last dimension of a message: STAT three numbers per token, SHARE two hidden vectors."""
    return {STAT: 3, SHARE: 2 * hidden}.get(message_key[0], hidden)
