"""Cost-balanced partitions and --allow-padding-num-layers on the engines equal the single-process
reference (loss, every gradient of the first step, weights after 3 AdamW steps, eval loss; fp32,
1e-5), in one launch at PP=2: a measured-costs list whose head weighs 4 layers under 1F1B, ZB-V
and DeepSpeed's own engine, "flops" under ZB-V, 6 layers over ZB-V's 4 stages with padding, and the costs'
cuts written as Megatron-core layouts (the same cuts, the same training)."""
from tests.gpt_harness import assert_schedules_match_reference

LAYERS = 6
# embedding, 6 transformer layers, final norm, head (4 layers' worth)
COSTS = "costs:[0.5, 1, 1, 1, 1, 1, 1, 0, 4]"
PIPELINES = [
    {"schedule": "1f1b", "partition_method": COSTS},
    {"schedule": "zbv", "partition_method": COSTS},
    {"partition_method": COSTS},                                   # DeepSpeed's stock engine
    {"schedule": "zbv", "partition_method": "flops"},
    {"schedule": "zbv", "partition_method": "type:transformer", "allow_padding_num_layers": True},
    # Megatron-core's written layouts of the costs' cuts (--pipeline-model-parallel-layout)
    {"schedule": "1f1b", "partition_method": "layout:Et*5|tL"},
    {"schedule": "zbv", "partition_method": "layout:Et|t*3|t*2|L"},
    {"partition_method": "layout:Et*5|tL"},
]
EXPECTED_PARTS = [
    [0, 6, 9],            # 5.5 | 1 layer + head = 5
    [0, 2, 5, 7, 9],      # rank 0: embedding + 1 layer, then norm + head = 5.5; rank 1: 3 + 2 layers = 5
    [0, 6, 9],
    [0, 3, 4, 6, 9],      # the tiny model's head (vocabulary 64) weighs 0.17 layer: 2 + 1 + head | 1 + 2
    [0, 3, 5, 6, 9],      # DeepSpeed's balanced cut: 2, 2, 1, 1 layers; rank 0 and rank 1 hold 3 each
    [0, 6, 9],            # the layouts: the costs' cuts above
    [0, 2, 5, 7, 9],
    [0, 6, 9],
]


def test_cost_partitions_and_padding_match_reference():
    per_rank = assert_schedules_match_reference(2, 2, 4, LAYERS, PIPELINES, steps=3, timeout=900)
    for i, expected in enumerate(EXPECTED_PARTS):
        parts = {tuple(r[i]["engine"]["parts"]) for r in per_rank}
        assert len(parts) == 1, parts
        assert list(parts.pop()) == expected, (PIPELINES[i], parts)
