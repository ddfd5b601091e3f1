"""The pieces of ``launch.lab.intervention``: segments, load runs, statistics, quality gates,
the verdict."""
