"""``trio-orch serve``: the command, its two fronts (uvicorn on asyncio, hypercorn on Trio),
signals and drain.
"""
