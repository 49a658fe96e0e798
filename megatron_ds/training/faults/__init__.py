"""What a run does when something goes wrong: one clear line, a known exit code, nothing lost.

disk_full.py (a save out of room), exit_signal.py (--exit-signal-handler), nonfinite.py (NaN/inf steps),
out_of_memory.py (the line that says where and what lowers it), timeouts.py (a collective that hangs)."""
