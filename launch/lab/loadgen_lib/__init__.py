"""The load generator's flag-free library (``launch.lab.loadgen`` is its CLI; tests import this).

Modules: ``slo`` (MLPerf presets), ``arrivals`` (open-loop arrival processes), ``workload``
(length profiles, traces, sessions), ``drivers`` (phaseserve, JetStream and OpenAI clients),
``runner`` (the open-loop run), ``report`` (statistics, CSV / JSON / PNG), ``capacity`` (the
resumable rate search) and ``app`` (a whole run from one ``LoadgenConfig``).
"""
