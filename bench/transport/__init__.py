"""Transport: env stepping over gRPC and shared memory, bare gRPC echo, weight sync, GameLink."""
