"""GPU sources: the one NVML gateway (`nvml`), how a GPU's state reads (`health`), XID lines and NVIDIA's catalog
(`xid`), and the per-boot ledger of XIDs seen (`faults`).

May import: trainguard.core, trainguard.node.
"""
