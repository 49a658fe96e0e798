"""The SAVE/zero_to_fp32.py every save writes is the package's own script (the multi-rank saves that copy it:
tests/training/test_save_folder.py); checked here without processes, so that a moved module fails fast."""
import os

import megatron_ds
from megatron_ds.training.checkpoint.recovery_script import SOURCE


def test_the_recovery_script_is_the_convert_package_s():
    assert SOURCE == os.path.join(os.path.dirname(megatron_ds.__file__), "convert", "zero_to_fp32.py")
    assert os.path.isfile(SOURCE)
