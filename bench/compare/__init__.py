"""``trio-orch compare``: cancellation semantics measured on every implementation."""
