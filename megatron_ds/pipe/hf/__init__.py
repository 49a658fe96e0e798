"""Any Hugging Face causal LM under our pipeline schedules: transformers' own modules cut into a DeepSpeed
PipelineModule (cut.py, layers.py) whose decoder layers run our attention (attention.py), for
megatron_ds.initialize."""
from .cut import PARTITION, CutError, hf_names, load, pipeline_module

__all__ = ["PARTITION", "CutError", "hf_names", "load", "pipeline_module"]
