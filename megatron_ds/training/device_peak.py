"""The dense bf16 peak of the accelerator, for MFU (model FLOPs / peak): known cards by
torch.cuda.get_device_name; None elsewhere (CPU, an unknown card), when no MFU is printed.
Vendors' dense (no sparsity) tensor-core bf16 numbers, TFLOP/s."""

# Ordered: the first pattern found in the lower-cased device name wins (specific names first).
PEAK_BF16_TFLOPS = (
    ("gh200", 989.0), ("h200", 989.0), ("h100 pcie", 756.0), ("h100 nvl", 835.0), ("h100", 989.0),
    ("h800", 989.0), ("b200", 2250.0), ("b100", 1750.0), ("a100", 312.0), ("a800", 312.0),
    ("l40s", 362.0), ("l4", 121.0), ("a10g", 125.0), ("a10", 125.0), ("a6000", 155.0),
    ("v100", 125.0), ("mi300x", 1307.0), ("mi250x", 383.0),
)


def peak_bf16_tflops(device_name):
    """The card's dense bf16 peak in TFLOP/s, or None when the name is not a card listed here."""
    name = (device_name or "").lower()
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in name:
            return peak
    return None


def this_device_peak():
    """peak_bf16_tflops of this process's CUDA device (None on CPU)."""
    import torch
    if not torch.cuda.is_available():
        return None
    return peak_bf16_tflops(torch.cuda.get_device_name(torch.cuda.current_device()))
