"""The runtime's side of the mixture-of-experts layers.

Read order: moe.py (expert-parallel groups, router steps and loss scaling, for every engine) ->
moe_checkpoint.py (an EP run saves and loads the checkpoint of the run without EP) -> overlap.py (overlapped
units: one micro-batch's forward and another's backward, each side's all-to-all hidden behind the other)."""
