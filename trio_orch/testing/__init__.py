"""Test doubles and checks shared by the test suite and bench/ (torch-free).

The toy pipeline (in-process stages with the shapes of the real ones) is in
:mod:`trio_orch.testing.toy_pipeline`.
"""

from trio_orch.testing.doubles import (
    LeakProbe,
    Misbehaviour,
    PushScriptedStage,
    ScriptedStage,
    StageRecord,
    SubmitHook,
    TerminalLedger,
    child_pids,
    fd_count,
    processes_naming,
    worker_alive,
)

__all__ = ["LeakProbe", "Misbehaviour", "PushScriptedStage", "ScriptedStage", "StageRecord", "SubmitHook",
           "TerminalLedger", "child_pids", "fd_count", "processes_naming", "worker_alive"]
