"""Ingest: records off the bus, decoded, validated and applied to the scheduler."""
