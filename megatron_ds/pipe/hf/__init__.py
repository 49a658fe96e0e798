"""Any Hugging Face causal LM under our pipeline schedules: transformers' own modules cut into a DeepSpeed
PipelineModule (cut.py, layers.py) whose decoder layers run our attention (attention.py), for
megatron_ds.initialize; the trained weights saved as a Hugging Face folder (save.py)."""
from .cut import PARTITION, CutError, hf_names, load, pipeline_module
from .save import save_pretrained

__all__ = ["PARTITION", "CutError", "hf_names", "load", "pipeline_module", "save_pretrained"]
