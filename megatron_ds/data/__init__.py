"""Data: Megatron's .bin/.idx datasets, tokenizers, GPT samples and blending, preprocessing.

- indexed_dataset: the MMIDIDX mmap format (reader, builder, merge, errors)
- tokenizer, gpt2_tokenization: build_tokenizer(args), GPT-2 BPE, PretrainedFromHF
- gpt_dataset, helpers, blendable_dataset, dataset_utils: samples, index caches, --split, blends
- preprocessing/: the code behind tools/preprocess_data*.py and merge_preprocessed_data.py
- default_corpus: an offline English corpus from Python's own documentation
Nothing here imports torch at import time except gpt_dataset / blendable_dataset.
"""
