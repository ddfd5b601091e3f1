"""The soak's flag-free parts behind ``launch.lab.soak``: ``traffic`` (the timeline and the
scheduling of every request), ``senders`` (the clients, the prompts, the variants and the check of
each answer), ``report`` (one record per request, the analysis and its assertions) and
``server_proc`` (the server process, the sampler, slopes and files)."""
