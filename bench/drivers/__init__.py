"""Thread-side drivers: one orchestrator implementation each, driven from the calling thread."""
