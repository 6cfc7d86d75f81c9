"""Training logs: reading only what was appended (`reader`), finding known failures in one Aho-Corasick pass
(`signatures`), explaining them (`oom`: parse, classify, explain a CUDA OOM; `diagnose`: NCCL, CUDA errors;
`collectives`: the story of a collective failure across ranks) and the node's context around them (`context`).

May import: trainguard.core, trainguard.node, trainguard.gpu.
"""
