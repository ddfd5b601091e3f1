"""phaseserve partitioning."""
