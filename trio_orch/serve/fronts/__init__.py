"""API-server processes: the head's engine served over ZMQ (host) to fronts that run the HTTP app (remote)."""
