"""When the loop saves and validates (training/loop.Cadence), without processes."""
import argparse

from megatron_ds.training.loop import Cadence


def flags(**kw):
    base = dict(save="ckpt", save_interval=4, eval_interval=3, load=None)
    return argparse.Namespace(**{**base, **kw})


def test_saves_every_interval_and_at_the_end_never_twice():
    cadence = Cadence(flags(), iteration=0, validates=True)
    assert [s for s in range(1, 11) if cadence.save_due(s)] == [4, 8]
    assert cadence.save_due(10, last=True)
    cadence.last_saved = 8
    assert not cadence.save_due(8, last=True)  # the end fell on a save: not again
    assert not Cadence(flags(save=None), 0, True).save_due(4, last=True)


def test_a_run_resumed_from_its_own_folder_has_its_first_iteration_on_disk():
    resumed = Cadence(flags(load="ckpt", save="./ckpt", save_interval=2), iteration=6, validates=False)
    assert not resumed.save_due(6, last=True) and resumed.save_due(8)
    assert Cadence(flags(load="other", save_interval=2), iteration=6, validates=False).save_due(6, last=True)


def test_validates_every_interval_and_at_the_end_unless_it_just_did():
    cadence = Cadence(flags(eval_interval=None), iteration=0, validates=True)
    assert not any(cadence.eval_due(s) for s in range(1, 10)) and cadence.eval_due(9, last=True)
    cadence = Cadence(flags(), iteration=0, validates=True)
    assert [s for s in range(1, 10) if cadence.eval_due(s)] == [3, 6, 9]
    cadence.last_evaluated = 9
    assert not cadence.eval_due(9, last=True)
    assert not Cadence(flags(), 0, validates=False).eval_due(3, last=True)  # no validation data
