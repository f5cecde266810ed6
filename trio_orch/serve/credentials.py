"""Where ``trio-orch serve`` and its clients find their secrets when no option gives them.

Kept apart from the server so that a client command (``trio-orch ctl``) names
the same variables without importing the HTTP app.
"""

from __future__ import annotations

__all__ = ["API_KEY_ENV", "TOKEN_ENV"]

#: the environment variable ``serve`` reads the API key from when ``--api-key`` is not given
API_KEY_ENV = "TRIO_ORCH_API_KEY"
#: the environment variable ``serve`` and ``ctl`` read the admin token from when no option gives it
TOKEN_ENV = "TRIO_ORCH_ADMIN_TOKEN"
