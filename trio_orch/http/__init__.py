"""The HTTP app: OpenAI-style chat completions and images, realtime, admin, health, metrics, models,
and the limits around them (Starlette; any ASGI server serves it).
"""
