"""Checkpoints of the vocabulary-parallel layout (pipe/vocab/vocab_checkpoint.py, training/checkpoint/relayout.py).

Each case trains 2 steps under one layout, saves, takes 2 more steps (the uninterrupted run), then a
fresh engine under another layout loads the checkpoint as training/checkpoint/save_load.plan_load says and
takes the same 2 steps: their losses and every weight after them (the vocabulary slices gathered into
whole matrices) equal the uninterrupted run's within 1e-5 fp32, so the weights, Adam's moments and fp32
masters (re-cut by name when vocabulary parallelism switches on or off, or the pipeline size changes)
and the step count all came back. VP->VP, VP->non-VP and non-VP->VP, tied (GPT-2) and untied (LLaMA),
at PP=2 x DP=2 and PP=4, and at PP=2 x TP=2 (each TP rank's layer file holds its rows [t V/TP,
(t+1) V/TP) as without vocabulary parallelism; the slices of rank (j, t) are rows j TP + t of p TP), in
one launch of 4 ranks; a control resumes with a fresh Adam and differs.
In the same launch, four steps go through the universal checkpoint (training/checkpoint/universal.convert, on
rank 0): a VP step resumes without VP at another pipeline and data-parallel size, a tied VP step under
VP at another pipeline size, a non-VP step under VP, a PP=2 x TP=2 VP step without VP at TP=1 x DP=2,
each as exactly as the cases above.
The layer files a vocabulary-parallel run writes are those of a run without it: the same files and
keys, the whole matrices equal to the saving run's, read by the offline reader (convert/ds_format.py)
and turned into a Hugging Face state dict like a non-VP checkpoint's.
"""
import os

import torch

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, ds_config, layer_key, micro_batch, optimizer_for, tiny_config,
                               whole_tensors)

WORLD, BATCH, LAYERS, TAG = 4, 8, 4, "step2"  # BATCH micro-batches per step, whatever the DP size
AFTER = (2, 3)  # the steps taken after the save (the first one's loss is the loaded weights')
LR = 1e-3  # as tests/pipe/vocab/test_vocab_engine.py: the sliced loss sums in another order (~1e-9 gradients)
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def layout(schedule, pp, vp, tp=1):
    return dict(schedule=schedule, pp=pp, vp=vp, tp=tp)


VP2, VP4, ZBV2 = layout("1f1b", 2, True), layout("1f1b", 4, True), layout("zbv", 2, True)
PLAIN2, PLAIN4 = layout("1f1b", 2, False), layout("1f1b", 4, False)
VP2T, ZBV2T, PLAIN2T = layout("1f1b", 2, True, 2), layout("zbv", 2, True, 2), layout("1f1b", 2, False, 2)
# (name, model, saved under, loaded under, optimizer state loaded)
CASES = [("vp_same_tied", {}, VP2, VP2, True), ("vp_pp2_to_pp4_untied", LLAMA, ZBV2, VP4, True),
         ("vp_to_plain_tied", {}, VP2, PLAIN2, True), ("vp_to_plain_untied", LLAMA, VP2, PLAIN4, True),
         ("plain_to_vp_tied", {}, PLAIN2, VP4, True), ("plain_to_vp_untied", LLAMA, PLAIN2, VP2, True),
         ("control_fresh_adam", LLAMA, VP2, PLAIN2, False),
         ("tp2_vp_same_untied", LLAMA, VP2T, VP2T, True), ("tp2_vp_zbv_to_1f1b_tied", {}, ZBV2T, VP2T, True),
         ("tp2_vp_to_plain_untied", LLAMA, VP2T, PLAIN2T, True), ("tp2_plain_to_vp_tied", {}, PLAIN2T, VP2T, True)]
# through the universal checkpoint (the folder names the whole parameters: any layout loads it)
UNIVERSAL = [("universal_vp_to_plain_untied", LLAMA, VP2, PLAIN4, True),
             ("universal_vp_to_vp_tied", {}, VP2, VP4, True),
             ("universal_plain_to_vp_untied", LLAMA, PLAIN2, VP4, True),
             ("universal_tp2_vp_to_plain_tp1_untied", LLAMA, VP2T, PLAIN2, True)]


def _engine(model, lay, universal=False):
    import torch.distributed as dist
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(LAYERS, **model, tensor_model_parallel_size=lay["tp"])
    dp = dist.get_world_size() // (lay["pp"] * lay["tp"])
    pipeline = {"schedule": lay["schedule"], "vocab_parallel": lay["vp"]}
    cfg = ds_config(lay["pp"], dp, BATCH // dp, pipeline=pipeline, lr=LR)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    module = build_pipeline_module(config, cfg, lay["pp"])
    return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR)), config


def _step(engine, config, step):
    gas, dp_rank = engine.micro_batches, engine.grid.get_data_parallel_rank()
    return float(engine.train_batch(iter([micro_batch(step, dp_rank * gas + j, config.vocab_size)
                                          for j in range(gas)])))


def _weights(engine, config):
    """{(global layer, name): whole tensor} this rank holds (every rank: the slices' gather is a collective)."""
    held = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return whole_tensors(engine, config, held)  # with TP the TP slices and each block's TP rows gathered too


def save_then_step(root, name, model, lay):
    """Two steps, save (through our checkpoint engine), two more: their losses and the weights at the save
    and after them."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from megatron_ds.model.universal_info import universal_checkpoint_info
    from megatron_ds.training.checkpoint import engine as checkpoint_engine
    engine, config = _engine(model, lay)
    for step in range(2):
        _step(engine, config, step)
    checkpoint_engine.install(engine)
    info = universal_checkpoint_info(config, config.vocab_size, vocab_parallel=lay["vp"])  # as training/checkpoint/save_load.py saves
    engine.save_checkpoint(os.path.join(root, name), tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: info})
    at_save = _weights(engine, config)
    losses = [_step(engine, config, step) for step in AFTER]
    return dict(at_save=at_save, losses=losses, after=_weights(engine, config))


def load_then_step(root, name, model, lay, optimizer, universal=False):
    """Load as plan_load says (`optimizer` False: as under --no-load-optim; `universal`: the converted
    folder, as under --universal-checkpoint), the same two steps."""
    from megatron_ds.pipe.engine import pipeline_layout, saved_layout
    from megatron_ds.training.checkpoint.save_load import plan_load, read_saved_state, restore
    engine, config = _engine(model, lay, universal)
    load_dir, tag = os.path.join(root, name), TAG + ("_universal" if universal else "")
    plan = plan_load(saved_layout(read_saved_state(load_dir, tag)), pipeline_layout(engine), finetune=False,
                     no_load_optim=not optimizer, zero_stage=1, universal=universal)
    restore(engine, load_dir, tag, plan)
    loaded, steps = _weights(engine, config), engine.global_steps
    losses = [_step(engine, config, step) for step in AFTER]
    return dict(plan=plan.optimizer, loaded=loaded, steps=steps, losses=losses, after=_weights(engine, config))


def rank_side(root):
    import deepspeed
    import torch.distributed as dist
    from megatron_ds.training.checkpoint.universal import convert
    deepspeed.init_distributed(dist_backend="gloo")
    saved = {name: save_then_step(root, name, model, before) for name, model, before, _, _ in CASES + UNIVERSAL}
    if dist.get_rank() == 0:
        for name, *_ in UNIVERSAL:
            step = os.path.join(root, name, TAG)
            convert(["--input_folder", step, "--output_folder", f"{step}_universal", "--num_extract_workers", "1",
                     "--num_merge_workers", "1"])
    dist.barrier()
    loaded = {name: load_then_step(root, name, model, after, optimizer, (name, model, before, after, optimizer)
                                   in UNIVERSAL)
              for name, model, before, after, optimizer in CASES + UNIVERSAL}
    return saved, loaded


def _merged(per_rank, name, key):
    """{(layer, name): tensor} over every rank's part of the model (copies agree: checked by the max diff)."""
    out = {}
    for saved, loaded in per_rank:
        out.update((saved if key in ("at_save", "after_saved") else loaded)[name]
                   ["after" if key == "after_saved" else key])
    return out


def _max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b), key=str)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_vocab_parallel_checkpoints_resume_under_any_layout(tmp_path):
    per_rank = run_ranks(WORLD, rank_side, str(tmp_path), timeout=900)
    expected_plan = {"vp_same_tied": "deepspeed", "tp2_vp_same_untied": "deepspeed", **{name: "universal" for name, *_ in UNIVERSAL}}
    for name, model, before, after, optimizer in CASES + UNIVERSAL:
        at_save, uninterrupted = _merged(per_rank, name, "at_save"), _merged(per_rank, name, "after_saved")
        loaded, resumed = _merged(per_rank, name, "loaded"), _merged(per_rank, name, "after")
        assert _max_diff(loaded, at_save) == 0.0, name  # the files hold exactly the saved weights
        for saved, mine in per_rank:
            assert mine[name]["steps"] == 2, name
            assert mine[name]["plan"] == (expected_plan.get(name, "by_name") if optimizer else None), name
        losses = [(a, b) for s, m in per_rank for a, b in zip(s[name]["losses"], m[name]["losses"])]
        diff = _max_diff(resumed, uninterrupted)
        print(f"{name}: weights after {len(AFTER)} steps differ by {diff:.2e}, losses by "
              f"{max(abs(a - b) for a, b in losses):.2e}")
        if optimizer:
            assert all(abs(a - b) <= 1e-5 for a, b in losses), (name, losses)
            assert diff <= 1e-5, (name, diff)
        else:  # Adam restarting from zero moments takes another step: the restored state is what matters
            assert diff > 1e-4, (name, diff)

    # The layer files of a VP run are a plain run's (same init, same two steps: equal within 1e-5)
    for vp, plain, model in (("vp_to_plain_tied", "plain_to_vp_tied", {}),
                             ("vp_to_plain_untied", "plain_to_vp_untied", LLAMA)):
        vp_dir, plain_dir = tmp_path / vp / TAG, tmp_path / plain / TAG
        layer_files = lambda d: sorted(p.name for p in d.iterdir() if p.name.startswith("layer_"))  # noqa: E731
        assert layer_files(vp_dir) == layer_files(plain_dir) == [f"layer_{i:02d}-model_states.pt" for i in
                                                                 range(LAYERS + (3 if model else 2))]
        for f in layer_files(vp_dir):
            a, b = torch.load(vp_dir / f), torch.load(plain_dir / f)
            assert sorted(a) == sorted(b), f
            assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5, f
        _offline_readers_agree(vp_dir, plain_dir, tiny_config(LAYERS, **model), _merged(per_rank, vp, "at_save"))

    # At TP 2 each TP rank's file holds its rows of the whole matrices, as a TP run without vocabulary
    # parallelism writes them: joined, they are the same model's at TP 1 (same steps: within 1e-5)
    tp1, tp2 = tmp_path / "vp_to_plain_untied" / TAG, tmp_path / "tp2_vp_to_plain_untied" / TAG
    for layer, key in ((0, "wte.weight"), (LAYERS + 2, "weight")):
        rows = [torch.load(tp2 / f"layer_{layer:02d}-model_{t:02d}-model_states.pt")[key] for t in range(2)]
        whole = torch.load(tp1 / f"layer_{layer:02d}-model_states.pt")[key]
        assert [r.shape[0] for r in rows] == [whole.shape[0] // 2] * 2, key
        assert (torch.cat(rows) - whole).abs().max().item() <= 1e-5, key


def _offline_readers_agree(vp_dir, plain_dir, config, at_save):
    """convert/ds_format.load_into and the Hugging Face state dict (export_hf's) of the VP checkpoint: the
    saving run's whole weights, and a plain checkpoint's within 1e-5."""
    from megatron_ds.convert.ds_format import load_into
    from megatron_ds.model import GPTModel
    from megatron_ds.convert.hf import to_hf_state_dict
    vp, plain = load_into(GPTModel(config), str(vp_dir)), load_into(GPTModel(config), str(plain_dir))
    by_layer = {k: p.detach() for k, p in vp.named_parameters_by_layer().items()}
    assert _max_diff(by_layer, {k: at_save[k] for k in by_layer}) == 0.0
    hf_vp = to_hf_state_dict(vp.named_parameters_by_layer(), config)
    hf_plain = to_hf_state_dict(plain.named_parameters_by_layer(), config)
    assert set(hf_vp) == set(hf_plain) and any("embed" in k or "wte" in k for k in hf_vp)
    assert max((hf_vp[k].float() - hf_plain[k].float()).abs().max().item() for k in hf_vp) <= 1e-5
    with torch.no_grad():  # and the models they make compute the same logits
        tokens = micro_batch(EVAL_STEP, 0, config.vocab_size)[0][0]
        assert (vp(tokens) - plain(tokens)).abs().max().item() <= 1e-4


def test_universal_info_names_the_slices_as_pipeline_replicated_vocabulary():
    """DeepSpeed's ds_to_universal keys the fragments it extracts by parameter name alone, so every pipeline
    rank's vocab_slice.wte would land on the others': a vocabulary-parallel step's universal_checkpoint_info
    names the slices (and, tied, layer 0's parameters) as that layout does and marks them pipeline-replicated,
    so the converter takes rank 0's alone, which training/checkpoint/universal.merge_vocab_slices replaces."""
    from deepspeed.checkpoint import constants as C
    from megatron_ds.model.universal_info import universal_checkpoint_info
    for model, slices in (({}, ["wte"]), (LLAMA, ["wte", "head"])):
        config = tiny_config(LAYERS, **model)
        info = universal_checkpoint_info(config, config.vocab_size, vocab_parallel=True)
        vocab = [rf"^vocab_slice\.{s}$" for s in slices]
        assert info[C.VOCABULARY_PARAMETER_PATTERNS] == info[C.PIPELINE_REPLICATED_PARAMETER_PATTERNS] == vocab
        assert not any("tied_modules" in p for v in info.values() if isinstance(v, list) for p in v
                       if isinstance(p, str))
        plain = universal_checkpoint_info(config, config.vocab_size)
        assert plain[C.VOCABULARY_PARAMETER_PATTERNS] != vocab


def test_a_folder_of_deepspeeds_converter_alone_is_refused(tmp_path):
    """A VP step converted by ds_to_universal alone holds a slice for the whole embedding: one message
    naming our converter."""
    from megatron_ds.training.checkpoint.universal import check_universal_folder
    (tmp_path / "global_step3_universal" / "zero" / "vocab_slice.wte").mkdir(parents=True)
    (tmp_path / "global_step3_universal" / "zero" / "optimizer_state.pt").write_bytes(b"")
    (tmp_path / "latest_universal").write_text("global_step3_universal")
    msg = check_universal_folder(str(tmp_path))
    assert "one pipeline rank's vocabulary slice" in msg
    assert (f"python -m megatron_ds.training.checkpoint.universal --input_folder {tmp_path}/global_step3 "
            f"--output_folder {tmp_path}/global_step3_universal") in msg
