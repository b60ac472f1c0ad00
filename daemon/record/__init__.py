"""What the daemon writes down: the decision journal, snapshots and canonical state dumps."""
