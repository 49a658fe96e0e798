"""Support shared by tests/ and bench/: the multi-process launcher and the timed layers.

Nothing in data/, model/, pipe/, schedules/ or training/ imports this package.
"""
