"""hlb's running service: config, logging, ingest, graph, policies, inference, gRPC, systemd.

Nothing in this package imports torch or ``sim``.
"""
