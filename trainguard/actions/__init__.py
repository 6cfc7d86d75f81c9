"""Actions: named responses to incident events, acting on a job (signal, switch files, requeue, hold an array) or on
this node (drain, resume), each one module beside the `Action` interface in `base`, listed in the registry.

May import: trainguard.core and the sources (node, gpu, jobs).
"""
