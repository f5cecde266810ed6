"""``trio-orch chaos``: the fault matrix over real worker processes."""
