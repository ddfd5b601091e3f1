"""Other engines side by side (``launch.bench_peers``): the flag-free core and the peer-side
scripts (each run by its own engine's interpreter, importing nothing from phaseserve)."""
