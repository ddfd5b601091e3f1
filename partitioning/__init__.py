"""phaseserve partitioning: the paper's layouts, how logical axes land on a mesh, per phase.

Meshes, named layouts, the shard_map forward with explicit collectives, the analytic cost model
(with its calibration), the planner and the measured autotune. Imports ``models`` only.
"""
