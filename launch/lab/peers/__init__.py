"""Other engines side by side (``launch.lab.bench_peers``): the flag-free core and the peer-side
scripts (each run by its own engine's interpreter, importing nothing from phaseserve)."""
