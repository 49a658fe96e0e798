#!/usr/bin/env python
"""The weights of a megatron_ds checkpoint as one fp32 state dict, read without running any code.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [-t TAG]

e.g. `python zero_to_fp32.py . out/` in the --save folder: every save writes this file there in place of
DeepSpeed's script of the same name and usage (megatron_ds/training/checkpoint/recovery_script.py). OUTPUT_DIR gets
pytorch_model.bin (or model.safetensors): the state dict of megatron_ds.model.GPTModel, fp32, from the step
`latest` names (or TAG). For a Hugging Face folder: tools/checkpoint/export_hf.py. The work is done by the
installed megatron_ds (megatron_ds/convert/consolidate.py), so run it with the Python that trained.
"""
import sys

try:
    from megatron_ds.convert.consolidate import main
except ModuleNotFoundError as e:
    if e.name != "megatron_ds":
        raise
    print("zero_to_fp32.py: error: megatron_ds is not installed in this Python: run it with the Python of the "
          "environment that trained (docs/INSTALL.md)", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
