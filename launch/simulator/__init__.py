"""The cluster capacity simulator behind ``launch.simulate`` (flag-free: tests import it).

``step_time``: step seconds (measured linear model, or the calibrated cost model);
``instance``: one model instance's scheduler, in token counts; ``cluster``: the event loop over
interleaved or disaggregated pools; ``workload``: requests from the load generator's profiles or
a trace; ``capacity``: the highest rate meeting an SLO at p99, cost per million tokens, the
prefill:decode split sweep; ``report``: CSV / JSON / PNG files.
"""
