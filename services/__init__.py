"""rlfleet shared runtime: server bootstrap, config, bus, codec, telemetry, launcher, CLI."""
