"""parse_args as the config tests call it: flags, an optional ds_config written as a file beside them (in
`folder`, else the working folder: empty_corpus's, tests/training/conftest.py), a world size."""
import json
from pathlib import Path

from megatron_ds.training.config.arguments import parse_args


def parse_with(base, *extra, world, ds=None, folder=None):
    argv = list(base) + list(extra)
    if ds is not None:
        path = Path(folder or ".") / "ds.json"
        path.write_text(json.dumps(ds))
        argv += ["--deepspeed_config", str(path)]
    return parse_args(argv, env={"WORLD_SIZE": str(world), "RANK": "0"})
