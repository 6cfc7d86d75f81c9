"""Training logs: reading only what was appended (`reader`), finding known failures in one Aho-Corasick pass
(`signatures`), explaining them (`diagnose`: OOM, NCCL, CUDA errors) and the node's context around them (`context`).

May import: trainguard.core, trainguard.node, trainguard.gpu.
"""
