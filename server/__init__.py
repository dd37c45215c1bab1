"""The gradq aggregator: rounds, the gRPC servicer and `gradq serve` (no torch here)."""
