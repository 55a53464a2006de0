"""Who answers: nodes that keep declining or never reply are rested, not flagged.

A declined task (the node says why), a node error, or no reply by the deadline is not a lie,
so it is never a flag (``nodes.engine.flags``). But a node that answers nothing round after round
costs every round its deadline and its place in the quorum. After ``rest_after`` rounds in
a row without a usable reply it is *rested*: not asked for as many rounds, then asked again.
Refusals are also counted per node, for the run's result.
"""

from __future__ import annotations


class Attendance:
    def __init__(self, rest_after: int) -> None:
        self.rest_after = rest_after
        self.misses: dict[str, int] = {}    # node -> rounds in a row without a usable reply
        self.resting: dict[str, int] = {}   # node -> the last round it is not asked
        self.declined: dict[str, int] = {}  # node -> tasks it declined, over the run

    def rested(self, round: int) -> set[str]:
        """The nodes not asked in round ``round``."""
        return {fp for fp, until in self.resting.items() if until >= round}

    def update(self, round: int, asked: list[str], answered: set[str], declined: set[str]) -> list[str]:
        """Record round ``round``: ``answered`` nodes sent a usable or rejected reply (a
        rejection is the flag policy's business), ``declined`` ones refused the task. Returns
        the nodes rested from the next round."""
        for fp in declined:
            self.declined[fp] = self.declined.get(fp, 0) + 1
        newly = []
        for fp in asked:
            if fp in answered:
                self.misses.pop(fp, None)
                continue
            self.misses[fp] = self.misses.get(fp, 0) + 1
            if self.misses[fp] >= self.rest_after:
                self.resting[fp] = round + self.rest_after
                del self.misses[fp]
                newly.append(fp)
        self.resting = {fp: until for fp, until in self.resting.items() if until > round}
        return sorted(newly)

    def state(self) -> dict:
        return {"misses": dict(self.misses), "resting": dict(self.resting), "declined": dict(self.declined)}

    def load_state(self, state: dict) -> None:
        self.misses, self.resting, self.declined = (dict(state[k]) for k in ("misses", "resting", "declined"))
