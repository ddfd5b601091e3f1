"""phaseserve serving."""
