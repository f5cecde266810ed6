"""Stage clients for worker processes: the ZMQ transport, replica pools, the launcher, supervision,
replicas that join over TCP (the registrar), and the Ray backend.

Nothing here is imported by the engine, nor the engine by it: a pipeline
factory (:func:`trio_orch.cluster.launcher.open_pipeline`) is what joins them.
"""
