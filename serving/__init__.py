"""phaseserve serving: many requests at once over one step (``models.step``) or a sharded one.

The engine side (paged KV pages, prefix cache, scheduler, engine, loop) and the service side
(frontend, validation, admission, auth, usage, the gRPC and HTTP servers) each state their
contract in their module docstring. Imports ``partitioning`` and ``models``, never ``launch``.
"""
