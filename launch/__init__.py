"""phaseserve launch: the command-line programs (absl flags live here and only here).

Each module with a ``main`` is run as ``python -m launch.<name>``; the flag-free helpers they share
(``cli``, ``machine``, ``compile_cache``, ``loadgen_lib``, ``simulator``, ...) hold the logic the
tests import. Imports flow one way: launch -> serving -> partitioning -> models.
"""
