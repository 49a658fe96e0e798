"""The pipeline plan is made once per run: parse_args makes it, the model build and the engine use that
object, and no other PipelinePlan is constructed on the way (one rank, a real DeepSpeed build)."""
import json
import os

from megatron_ds.testing.launcher import run_ranks


def _parse_and_build(folder, pipeline):
    import deepspeed

    from megatron_ds.pipe.plan import plan as plan_module
    from megatron_ds.training.config.arguments import parse_args
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
    args = args.replace(padded_vocab_size=64)  # the tokenizer's, which the "flops" cut weighs at build time
    engine, _ = setup_model_and_optimizer(args)
    return parsed, len(made), engine.plan is args.pipeline_plan, engine.module.plan is args.pipeline_plan, \
        list(engine.module.parts)


def test_the_plan_is_made_once_at_parse_time_and_used_by_the_build(tmp_path):
    (result,) = run_ranks(1, _parse_and_build, str(tmp_path), {"schedule": "1f1b", "partition_method": "flops"},
                          quiet=True)
    parsed, total, engine_holds_it, module_holds_it, parts = result
    assert (parsed, total, engine_holds_it, module_holds_it) == (1, 1, True, True)
    assert parts == [0, 5]  # one stage: the embedding, 2 layers, the norm and the head


def test_the_start_up_line_says_what_the_schedule_name_does_not(tmp_path):
    """Seq1F1B's segment lengths, vocabulary parallelism, a schedule file's simulated makespan and "auto"'s budget
    in micro-batches."""
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.pipe.plan.plan import make_plan
    from megatron_ds.schedules import build_schedule, simulate
    from megatron_ds.training.model_setup import engine_line

    config = GPTConfig(vocab_size=64, hidden_size=64, num_layers=4, num_attention_heads=4, max_position_embeddings=64)
    batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}

    def line(pipeline):
        ds_config = {**batch, "pipeline": pipeline}
        plan, auto_plan = make_plan(config, ds_config, 2, 1)
        return engine_line("ScheduleEngine", pipeline_settings(ds_config), plan, auto_plan)

    seq = line({"schedule": "seq1f1b", "seq_splits": 4})
    assert seq.startswith("> pipeline engine: ScheduleEngine, schedule seq1f1b")
    assert "segment lengths [16, 16, 8, 24] tokens" in seq
    assert "vocabulary parallel" in line({"schedule": "1f1b", "vocab_parallel": True})
    assert line({"schedule": "zbv"}) == "> pipeline engine: ScheduleEngine, schedule zbv"
    # the overlapped units, per rank (ranks 0, 1 where they differ): the log says the overlap is on
    units = [len(p) for p in build_schedule("1f1b", 2, 4, overlap=True).overlap]
    assert line({"schedule": "1f1b", "overlap": True}) == (
        f"> pipeline engine: ScheduleEngine, schedule 1f1b (overlapped F/B units: {units} per rank)")
    assert units == [1, 3]
    path = tmp_path / "zbv.json"
    path.write_text(build_schedule("zbv", 2, 4).to_json())
    makespan = simulate(build_schedule("zbv", 2, 4)).makespan
    assert f"simulated makespan {makespan:g}" in line({"schedule": f"file:{path}"})
    stock = engine_line("PipelineEngine", pipeline_settings({}), None)
    assert stock == "> pipeline engine: PipelineEngine, schedule deepspeed"
    auto = line({"schedule": "auto", "memory_budget": "1GiB"})  # docs/TRAINING.md's "Choosing a schedule" says it is logged
    assert auto.startswith("> pipeline engine: ScheduleEngine, schedule auto; memory_budget \"1GiB\" = ")
    assert "micro-batches of" in auto and "; starts on zb-h1" in auto
