"""Bad input to the checkpoint tools: exit code 2, one message naming the file or key and the rule,
and nothing written (no output folder, no temporary folder left beside it)."""
import json
import os
import shutil

import pytest
import torch

from megatron_ds.testing.launcher import child_env
from tests.convert.helpers import gpt2_files, tiny_hf_gpt2, tool

IMPORT, EXPORT = "checkpoint/import_hf.py", "checkpoint/export_hf.py"


def _nothing_written(out):
    parent = os.path.dirname(out)
    leftovers = [n for n in os.listdir(parent) if n.startswith(f".{os.path.basename(out)}.tmp")]
    return not os.path.exists(out) and not leftovers


def _fails(capsys, relpath, *argv, out, says):
    capsys.readouterr()
    assert tool(relpath, *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{os.path.basename(relpath)}: error: "), err
    for text in says:
        assert text in err[0], (text, err[0])
    assert _nothing_written(str(out))
    return err[0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    tiny_hf_gpt2(str(path))
    return path


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "imported"
    assert tool(IMPORT, "--input", hf_dir, "--output", out) == 0
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_another_architecture(tmp_path, capsys):
    import transformers
    other = tmp_path / "opt"
    transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                       ffn_dim=32, num_attention_heads=2,
                                                       max_position_embeddings=32)).save_pretrained(other)
    _fails(capsys, IMPORT, "--input", other, "--output", tmp_path / "out", out=tmp_path / "out",
           says=[str(other / "config.json"), "OPTForCausalLM", "'opt'", "not supported"])


def test_vocabulary_that_does_not_fit(tmp_path, hf_dir, capsys):
    small = tmp_path / "small_vocab"
    tiny_hf_gpt2(str(small), vocab_size=1000)  # fewer rows than the GPT-2 BPE has tokens
    _fails(capsys, IMPORT, "--input", small, "--output", tmp_path / "out", out=tmp_path / "out",
           says=["config.json: vocab_size 1000 does not fit", "50257"])
    # 50257 rows, but the flags pad the 50257 tokens to a multiple of 128
    _fails(capsys, IMPORT, "--input", hf_dir, "--output", tmp_path / "out", "--make-vocab-size-divisible-by", 128,
           out=tmp_path / "out", says=["vocab_size 50257 does not fit", "padded to 50304"])


def test_missing_weight_file_and_key(tmp_path, hf_dir, capsys):
    bare = _copy(hf_dir, tmp_path / "no_weights")
    os.remove(bare / "model.safetensors")
    _fails(capsys, IMPORT, "--input", bare, "--output", tmp_path / "out", out=tmp_path / "out",
           says=[str(bare), "no weight file", "model.safetensors"])
    sharded = _copy(hf_dir, tmp_path / "sharded")
    with open(sharded / "model.safetensors.index.json", "w") as f:
        shards = {"transformer.wte.weight": "model-00001-of-00002.safetensors",
                  "transformer.h.0.ln_1.weight": "model-00002-of-00002.safetensors"}
        json.dump({"metadata": {}, "weight_map": shards}, f)
    os.rename(sharded / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    _fails(capsys, IMPORT, "--input", sharded, "--output", tmp_path / "out", out=tmp_path / "out",
           says=[str(sharded / "model-00002-of-00002.safetensors"), "missing"])
    from safetensors.torch import load_file, save_file
    holed = _copy(hf_dir, tmp_path / "holed")
    sd = load_file(holed / "model.safetensors")
    del sd["transformer.h.2.mlp.c_fc.weight"]
    save_file(sd, holed / "model.safetensors")
    _fails(capsys, IMPORT, "--input", holed, "--output", tmp_path / "out", out=tmp_path / "out",
           says=["'transformer.h.2.mlp.c_fc.weight'"])


def test_checkpoint_without_latest_or_layer_file(tmp_path, ckpt, capsys):
    broken = _copy(ckpt, tmp_path / "no_latest")
    os.remove(broken / "latest")
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(broken / "latest"), "missing"])
    (broken / "latest").write_text("\n")  # else --load itself would pass for the step's folder
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(broken / "latest"), "empty"])
    (broken / "latest").write_bytes(b"\xff\xfe\x00global_step0")
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(broken / "latest"), "unreadable"])
    (broken / "latest").write_text("global_step9")
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(broken / "latest"), "'global_step9'", "does not exist"])
    _fails(capsys, EXPORT, "--load", tmp_path / "nowhere", "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(tmp_path / "nowhere"), "no such checkpoint folder"])
    broken = _copy(ckpt, tmp_path / "no_layer")
    os.remove(broken / "global_step0" / "layer_03-model_states.pt")
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(broken / "global_step0"), "layer_03-model_states.pt is missing"])
    # a layer file changed after saving: the manifest's CRC-32 catches it; without a manifest
    # (a checkpoint DeepSpeed wrote itself), the shape check does
    broken = _copy(ckpt, tmp_path / "bad_key")
    path = broken / "global_step0" / "layer_02-model_states.pt"
    sd = torch.load(path)
    sd["attn.c_attn.weight"] = sd["attn.c_attn.weight"][:, :8]
    torch.save(sd, path)
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=["layer_02-model_states.pt is corrupt"])
    os.remove(broken / "global_step0" / "manifest.json")
    _fails(capsys, EXPORT, "--load", broken, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(path), "'attn.c_attn.weight'", "shape"])


def test_output_folder_must_be_new(tmp_path, hf_dir, ckpt, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert tool(IMPORT, "--input", hf_dir, "--output", out) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    assert tool(EXPORT, "--load", ckpt, "--output", out) == 2
    assert os.listdir(out) == ["keep.txt"]


def test_output_parent_folders_are_made_as_mkdir_p_would(tmp_path, hf_dir, ckpt, capsys):
    """docs/CHECKPOINTS.md's `--output runs/export/hf` in a fresh clone: the missing parents are made when the folder
    is written, not before (a failed run leaves none); a parent that is a file is refused up front."""
    assert tool(EXPORT, "--load", ckpt, "--output", tmp_path / "runs" / "export" / "hf") == 0
    assert (tmp_path / "runs" / "export" / "hf" / "config.json").is_file()
    assert tool(IMPORT, "--input", hf_dir, "--output", tmp_path / "runs" / "ft" / "init") == 0
    assert (tmp_path / "runs" / "ft" / "init" / "latest").is_file()
    capsys.readouterr()
    assert tool(EXPORT, "--load", tmp_path / "nowhere", "--output", tmp_path / "later" / "hf") == 2
    assert not (tmp_path / "later").exists()
    (tmp_path / "plain").write_text("x")
    capsys.readouterr()
    assert tool(EXPORT, "--load", ckpt, "--output", tmp_path / "plain" / "sub" / "hf") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"export_hf.py: error: {tmp_path / 'plain'}: not a folder"), err


def test_command_line_exit_code_and_one_line(tmp_path, hf_dir):
    """The real commands: exit status 2 and exactly one line on stderr (no library chatter)."""
    import subprocess
    import sys
    from tests.convert.helpers import ROOT, TOOLS
    bare = _copy(hf_dir, tmp_path / "no_weights")
    os.remove(bare / "model.safetensors")
    for script, argv, message in (
            ("checkpoint/import_hf.py", ["--input", bare], f"import_hf.py: error: {bare}: no weight file (looked for "
             "model.safetensors.index.json, model.safetensors, pytorch_model.bin.index.json, pytorch_model.bin)"),
            ("checkpoint/export_hf.py", ["--load", tmp_path / "nowhere"],
             f"export_hf.py: error: {tmp_path / 'nowhere'}: no such checkpoint folder")):
        proc = subprocess.run([sys.executable, os.path.join(TOOLS, script), *map(str, argv),
                               "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                              env=child_env(ROOT, OMP_NUM_THREADS="1"), cwd=ROOT)
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [message]
        assert proc.stdout == "" and _nothing_written(str(tmp_path / "out"))


def test_moe_options_our_layers_or_hugging_face_lack(tmp_path, capsys):
    """Import: a Mixtral with router jitter, a Qwen3-MoE with attention biases (a head_dim other than hidden /
    heads imports: --kv-channels). Export: a MoE with a shared expert, which neither Mixtral nor Qwen3-MoE has."""
    import transformers
    rope = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    jitter = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**rope, num_local_experts=2,
                                                               router_jitter_noise=0.1)).save_pretrained(jitter)
    _fails(capsys, IMPORT, "--input", jitter, "--output", tmp_path / "out", out=tmp_path / "out",
           says=[str(jitter / "config.json"), "'mixtral'", "router_jitter_noise 0.1"])
    biased = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**rope, head_dim=16, num_experts=2, attention_bias=True,
                                                                 num_experts_per_tok=1)).save_pretrained(biased)
    _fails(capsys, IMPORT, "--input", biased, "--output", tmp_path / "out", out=tmp_path / "out",
           says=[str(biased / "config.json"), "'qwen3_moe'", "attention_bias"])
    from megatron_ds.convert.ds_format import write_checkpoint
    from megatron_ds.convert.model_args import config_flags, parse_flags
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.model import GPTModel
    from megatron_ds.moe_config import MoEConfig
    config = GPTConfig(vocab_size=50257, hidden_size=16, num_layers=1, num_attention_heads=2,
                       max_position_embeddings=16, normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
                       add_bias_linear=False, moe=MoEConfig(num_experts=2, shared_expert_intermediate_size=8))
    vocab, merges = gpt2_files()
    args = parse_flags(config_flags(config, 16) + ["--vocab-file", vocab, "--merge-file", merges,
                                                   "--pad-vocab-size-to", "50257"])
    args.padded_vocab_size = 50257
    shared = tmp_path / "shared_expert"
    write_checkpoint(str(shared), GPTModel(config).named_parameters_by_layer(), args)
    _fails(capsys, EXPORT, "--load", shared, "--output", tmp_path / "hf", out=tmp_path / "hf",
           says=[str(shared), "--moe-shared-expert-intermediate-size (a shared expert): Mixtral and Qwen3-MoE have "
                              "no such option"])
