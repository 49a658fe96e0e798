"""Support shared by tests/, bench/ and tools/: the multi-process launcher, the timed layers and a
tiny random .bin/.idx corpus.

Nothing in data/, model/, pipe/, schedules/ or training/ imports this package.
"""
