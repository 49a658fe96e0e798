"""How saves are written and kept: --async-save, --keep-last-checkpoints, --keep-every, --save-write-probe-mib.

Each may also be given in the ds_config's "checkpoint" section (DeepSpeed's, which reads only the keys it
knows there: "async_save", "keep_last", "keep_every" are ours); a flag and a key that disagree are refused,
naming both, and the ds_config DeepSpeed gets carries the merged values. DeepSpeed's own background writer
("checkpoint": {"writer": {"decoupled": true}}: a writer process a rank) has rank 0 write `latest` once its own
writer is done, without asking the other ranks, and in place (no rename), so it is refused beside
--async-save. Checked at parse time (no torch).
"""

SECTION = "checkpoint"
KEYS = {"async_save": ("--async-save", bool), "keep_last": ("--keep-last-checkpoints", int),
        "keep_every": ("--keep-every", int)}
DEST = {"async_save": "async_save", "keep_last": "keep_last_checkpoints", "keep_every": "keep_every"}  # flags' names
DEFAULT_PROBE_MIB = 256


def add_save_args(parser):
    g = parser.add_argument_group("saving in the background, keeping checkpoints")
    g.add_argument("--async-save", action="store_true", default=None,
                   help="the saving iteration stops only to copy the states to host memory; a background writer "
                        "writes the files, and `latest` names the step once every rank's files are whole "
                        "(Megatron's flag; ds_config \"checkpoint\": {\"async_save\": true})")
    g.add_argument("--keep-last-checkpoints", type=int, default=None, metavar="N",
                   help="keep the last N committed steps of --save; older ones are deleted once a newer one is "
                        "committed (ds_config \"checkpoint\": {\"keep_last\": N}; default: keep all)")
    g.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="with --keep-last-checkpoints: steps at multiples of K iterations are kept too "
                        "(ds_config \"checkpoint\": {\"keep_every\": K})")
    g.add_argument("--save-write-probe-mib", type=int, default=None, metavar="MIB",
                   help="once a run, at its first save, each rank writes and fsyncs MIB MiB to --save (then "
                        "deletes it): the plain sequential write the save's throughput is logged against; 0: off "
                        f"(default: {DEFAULT_PROBE_MIB} with --async-save, else 0)")


def apply_save_args(args, ds_config, err):
    """Merge the flags with ds_config "checkpoint" (written back into it: DeepSpeed ignores our keys) and
    check them; returns (async_save, keep_last_checkpoints, keep_every, save_write_probe_mib) for the parser to
    write. `err` raises the ArgumentsError."""
    section = ds_config.get(SECTION) or {}
    src = args.deepspeed_config
    merged = {}
    for key, (flag, kind) in KEYS.items():
        flag_value, key_value = getattr(args, DEST[key]), section.get(key)
        if key_value is not None and (type(key_value) is not kind):
            err(f"ds_config \"{SECTION}\": {{\"{key}\": {key_value!r}}} in {src}: must be "
                f"{'true or false' if kind is bool else 'an integer'}")
        if flag_value is not None and key_value is not None and flag_value != key_value:
            err(f"{flag} {flag_value} disagrees with ds_config \"{SECTION}\": {{\"{key}\": {key_value!r}}} in {src}; "
                "give one of them, or make them equal")
        merged[key] = flag_value if flag_value is not None else key_value
    merged["async_save"] = bool(merged["async_save"])
    for key in ("keep_last", "keep_every"):
        if merged[key] is not None and merged[key] < 1:
            err(f"{KEYS[key][0]} must be at least 1, got {merged[key]}")
    if merged["keep_every"] is not None and merged["keep_last"] is None:
        err("--keep-every K keeps steps beside --keep-last-checkpoints N, which is missing (without it every "
            "step is kept)")
    probe = args.save_write_probe_mib
    if probe is None:
        probe = DEFAULT_PROBE_MIB if merged["async_save"] else 0
    if probe < 0:
        err(f"--save-write-probe-mib must be >= 0, got {probe}")
    if merged["async_save"] and (section.get("writer") or {}).get("decoupled"):
        err(f"--async-save and ds_config \"{SECTION}\": {{\"writer\": {{\"decoupled\": true}}}} in {src}: "
            "DeepSpeed's decoupled writer names `latest` once rank 0's files are written, not every rank's; give "
            "one of them")
    if any(merged[k] is not None and merged[k] is not False for k in KEYS):
        ds_config[SECTION] = {**section, **{k: v for k, v in merged.items() if v is not None}}
    return merged["async_save"], merged["keep_last"], merged["keep_every"], probe
