"""The daemon's life as a service: wiring, replay, reload, metrics and systemd's notify protocol."""
