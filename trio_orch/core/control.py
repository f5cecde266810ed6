"""Control-plane rules: which stages a collective call addresses.

A collective RPC is not a request: it never touches request state.  What
the core decides is the target set -- all stages, or the ones named, each
checked (the seed skips an invalid stage id silently; here it is an error).
"""

from __future__ import annotations

from collections.abc import Iterable

from trio_orch.core.state import CoreState

__all__ = ["ControlRules"]


class ControlRules(CoreState):
    """Targets of collective calls."""

    def check_stage_ids(self, stage_ids: Iterable[int] | None) -> list[int]:
        """The stages a collective call goes to, sorted; ``None``: every stage.  Raises ValueError."""
        if stage_ids is None:
            return list(range(self.num_stages))
        if isinstance(stage_ids, (str, bytes)) or not isinstance(stage_ids, Iterable):
            raise ValueError(f"stage_ids must be a collection of stage numbers, got {stage_ids!r}")
        chosen = list(stage_ids)
        bad = [k for k in chosen if isinstance(k, bool) or not isinstance(k, int)
               or not 0 <= k < self.num_stages]
        if bad:
            raise ValueError(f"invalid stage ids {bad}: stages are 0..{self.num_stages - 1}")
        if not chosen:
            raise ValueError("stage_ids is empty: name at least one stage (or None for all)")
        return sorted(set(chosen))
