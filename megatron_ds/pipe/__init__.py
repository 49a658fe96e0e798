"""The runtime: a schedule's op lists run by DeepSpeed's pipeline engine, and the module they run on.

The engine core sits here: engine.py (ScheduleEngine, the interpreter) -> instructions.py (the op lists as a
DeepSpeed PipeSchedule) -> p2p.py (a MessagePlan's sends and receives) -> activations.py (what a chunk hands the
next) -> replicas.py (BitPipe's twin chunks) -> trace.py (op traces) -> post_validation.py (the optimizer's
step, post-validated) -> auto.py ("auto"'s timing and switch); module.py cuts the layers into the schedule's
chunks and build.py makes the module and the engine from a ds_config. Subpackages, by concern, bottom to top
(each imports only those below it; tests/test_import_graph.py enforces it):
- plan/: the run's plan, pure data at parse time (no torch, no DeepSpeed; plan.py first);
- deepspeed/: DeepSpeed's private members this package touches, in one audited place each;
- parallel/: context parallelism's groups and shards, sequence parallelism's gradient sum;
- moe/, vocab/: mixture of experts (and its overlapped units), vocabulary parallelism;
- foreign/: a user's own DeepSpeed PipelineModule on our schedules (above the core: it subclasses the engine);
- hf/: any Hugging Face causal LM cut into such a module from transformers' own layers (on top: it runs on foreign/).
"""
