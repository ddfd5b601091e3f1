"""One-off CPU model-speed A/Bs whose figures are in ``results/model_speed/`` (each module's
docstring gives its command, run from the repository root with ``python -m``)."""
