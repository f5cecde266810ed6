"""OpenAI request handling without a web framework: what the HTTP routes and the command line share.

The request schemas (:mod:`.protocol`) and the one validator that reads them
(:mod:`.validation`: the JSON body, the schema, every refusal a ``BadRequest``
naming the field); how request fields become each stage's sampling
parameters (:mod:`.sampling`); images and audio in a chat (:mod:`.media`);
the audio the server sends, in every format, from one encoder (:mod:`.audio_out`);
the chat template (:mod:`.chat_template`); the chat request and its answer
(:mod:`.chat`), the text completion (:mod:`.completions`), speech
(:mod:`.speech`) and image requests (:mod:`.images`); the pipeline's
tokenizer (:mod:`.tokenizer`); the Realtime session's protocol
(:mod:`.realtime`, :mod:`.realtime_events`).  Nothing here imports Starlette
or any other web framework (``tests/project/test_layout.py``): the engine
is reached through its seam, ``trio_orch.engine.api``.
"""
