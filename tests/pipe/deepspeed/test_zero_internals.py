"""Every private member of DeepSpeed's ZeRO optimizer the package uses exists in the installed DeepSpeed."""
import inspect

import deepspeed
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from megatron_ds.pipe.deepspeed.zero_internals import ZeroInternals


def test_every_private_deepspeed_member_the_package_uses_exists():
    missing = [m for m in ZeroInternals.METHODS if not callable(getattr(DeepSpeedZeroOptimizer, m, None))]
    assert not missing, (f"DeepSpeed {deepspeed.__version__} lacks {missing} "
                         f"(read from {ZeroInternals.DEEPSPEED_VERSION})")
    source = inspect.getsource(DeepSpeedZeroOptimizer)
    assert all(f"self.{a} =" in source for a in ZeroInternals.ATTRIBUTES)
    assert all(f".{a} = " in source for a in ZeroInternals.PARAM_ATTRIBUTES + ZeroInternals.TENSOR_ATTRIBUTES)
