"""``trio-orch serve``: the command, its two fronts (uvicorn on asyncio; on Trio the lean server of
:mod:`trio_orch.serve.trio_http`, or hypercorn), signals and drain.
"""
