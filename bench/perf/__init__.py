"""``trio-orch bench``: dispatch latency and throughput of every implementation."""
