"""The pipeline plan is made once per run: parse_args makes it, the model build and the engine use that
object, and no other PipelinePlan is constructed on the way (one rank, a real DeepSpeed build)."""
import json
import os

from megatron_ds.testing.launcher import run_ranks


def _parse_and_build(folder, pipeline):
    import deepspeed

    from megatron_ds.pipe import plan as plan_module
    from megatron_ds.training.arguments import parse_args
    from megatron_ds.training.model_setup import setup_model_and_optimizer

    made = []
    init = plan_module.PipelinePlan.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        init(self, *args, **kwargs)

    plan_module.PipelinePlan.__init__ = counted
    os.chdir(folder)
    for ext in (".bin", ".idx"):
        open(f"corpus{ext}", "wb").close()
    with open("ds.json", "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                   "zero_optimization": {"stage": 1}, "pipeline": pipeline}, f)
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                       "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", "ds.json",
                       "--merge-file", "ds.json", "--micro-batch-size", "1", "--deepspeed_config", "ds.json"])
    parsed = len(made)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    args.padded_vocab_size = 64  # the tokenizer's, which the "flops" cut weighs at build time
    engine, _ = setup_model_and_optimizer(args)
    return parsed, len(made), engine.plan is args.pipeline_plan, engine.module.plan is args.pipeline_plan, \
        list(engine.module.parts)


def test_the_plan_is_made_once_at_parse_time_and_used_by_the_build(tmp_path):
    (result,) = run_ranks(1, _parse_and_build, str(tmp_path), {"schedule": "1f1b", "partition_method": "flops"},
                          quiet=True)
    parsed, total, engine_holds_it, module_holds_it, parts = result
    assert (parsed, total, engine_holds_it, module_holds_it) == (1, 1, True, True)
    assert parts == [0, 5]  # one stage: the embedding, 2 layers, the norm and the head
