"""The daemon's state: the infrastructure graph, device profiles and the placement ledger."""
