"""The digital twin: device catalogue, topology, workloads, simulator, evaluation, simulated agents.

Depends on ``daemon``; never on torch.
"""
