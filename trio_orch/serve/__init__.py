"""``trio-orch serve``: the command (flags into options), its twin fronts -- uvicorn on asyncio
(:mod:`.asyncio_front`), the lean server of :mod:`.trio_http` on Trio (:mod:`.trio_front`) --,
signals and drain.
"""
