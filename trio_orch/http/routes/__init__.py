"""The HTTP routes, one module per route family (as vLLM's ``entrypoints/openai/<family>/``).

:mod:`.chat` (``/v1/chat/completions``), :mod:`.completions`
(``/v1/completions``), :mod:`.speech` (``/v1/audio/speech``), :mod:`.images`
(``/v1/images/generations``), :mod:`.tokenize` (``/tokenize``,
``/detokenize``), :mod:`.realtime` (the ``/v1/realtime`` WebSocket),
:mod:`.admin` (``/admin/...``) and :mod:`.status` (``/v1/models``,
``/health``, ``/metrics``, ``/version``, ``/ping``).  Each module reads its
requests with :mod:`trio_orch.openai` and answers through
:class:`~trio_orch.http.generation.OpenAIRoute`; :func:`trio_orch.http.app.create_app`
assembles them.
"""
