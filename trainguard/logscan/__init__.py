"""Training logs: reading only what was appended (`reader`), finding known failures in one Aho-Corasick pass
(`signatures`) on lines made plain first (`lines`: rank prefixes, progress bars, wrapped lines, timestamps),
explaining them (`oom`: parse, classify, explain a CUDA OOM; `diagnose`: NCCL timeouts, CUDA errors; `nccl`: the
other NCCL error classes; `launcher`: torchrun's root cause; `collectives`: the story of a collective failure across
ranks) and the node's context around them (`context`).

May import: trainguard.core, trainguard.node, trainguard.gpu.
"""
