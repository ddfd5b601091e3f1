"""The cluster capacity simulator behind ``launch.lab.simulate`` (flag-free: tests import it).

``step_time``: step seconds (a measured linear model, or the calibrated cost model) and KV
capacity; ``instance``: one model instance's scheduler, in token counts; ``cluster``: the event
loop over interleaved or disaggregated pools; ``workload``: requests from the load generator's
profiles or a trace; ``capacity``: the highest rate meeting an SLO at p99, cost per million
tokens, the prefill:decode split sweep; ``deploy``: instances, layouts and pools of a model on a
cluster; ``compare``: the hardware x dtype x chips grid; ``report``: CSV / JSON / PNG files;
``live``: the live engine on a trace, for checking the simulator against it.
"""
