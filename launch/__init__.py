"""phaseserve launch."""
