"""Checks: one module per check type (`<type>.py`), each a small class that gathers, evaluates and summarizes into
immutable results. `base` holds the interface (Check, CheckSettings, the typed CheckContext) and the two family bases
(JobCheck, NvmlCheck); `capacity` the bytes-and-inodes evaluation that disk and quota share.

May import: trainguard.core and the sources (node, gpu, jobs, logscan, quota); never the pipeline or the shell.
"""
