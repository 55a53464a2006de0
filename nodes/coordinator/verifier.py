"""The coordinator's spot checks (``nodes.engine.spotcheck``): who recomputes, and the verdicts.

:class:`SpotChecks` is the round engine's verifier in a deployment. With ``verifier =
"nodes"`` each drawn update goes to another volunteer of the round (seeded choice, never
its author), as a spot-check task: the author's own task (a straggler's: the older model it
was sent, under its task number) and declared data part. The verifier's signed recomputation
clears the update when it matches; when it does not, or the verifier refuses, fails or is
late, the coordinator recomputes itself, from the same task, and referees. With ``verifier =
"self"`` the coordinator recomputes every check. Nothing a verifier sends can raise: a bad
answer is a reason in the verdict's note, and the coordinator's own recomputation decides.

A check that disagrees across compute profiles (the author, or a verifier, declared another
profile than the coordinator's) opens a dispute with the node whose row disagrees, and the
ruling decides (``nodes.coordinator.arbitration``); so does a share (``dispute-share``) of the
checks that passed across profiles with other bits. Asynchronous rounds ask no verifier (the
coordinator recomputes each check itself) but do ask for disputes. Under ``momentum`` the
coordinator recomputes every check itself too, from the momentum the task named
(``nodes.engine.states``: a verifier would need it sent), and a row across profiles is refereed
at once as the one step it is (``nodes.engine.referee.settle_step``): no dispute, nothing travels.

With compression the authors' rows are the decoded ones; a verifier sends its recomputation
encoded like an update (with the author's codec key) and signs the decoded row; the
coordinator's own recomputation is encoded and decoded the same way (``transmitted``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from flwr.app import RecordDict

from robust import keys
from robust.codecs import Codec
from robust.codecs.sparse import SparseCodec
from robust.params import sha256

from ..engine.ledger import Ticket
from ..engine.referee import settle_step
from ..engine.spotcheck import SELF, Verdict, assign, compare, distance, referee, round_seed, uniform
from ..engine.training import NodeData, compute, part_of, transmitted
from ..wire import Reply, Task, read_reply, reply_payload, task_content
from . import arbitration
from .audit import keep_row
from .arbitration import Dispute, Referee

CPU = torch.device("cpu")
log = logging.getLogger(__name__)
Ask = Callable[[dict[str, tuple[str, RecordDict]]], dict[str, RecordDict | str]]


@dataclass
class Checkers:
    """This round's volunteers that may verify, and how to ask them: ``ask({author: (verifier,
    task content)})`` returns ``{author: the verifier's reply content, or why there is none}``."""

    candidates: list[str]
    ask: Ask


class SpotChecks:
    def __init__(self, coord) -> None:
        self.coord = coord
        self.replies: dict[str, Reply] = {}
        self.checkers: Checkers | None = None
        self.evidence: set[str] = set()  # SHA-256 of the rows this round's mismatches stored as float32 evidence
        self._parts: dict[str, NodeData] = {}

    @cached_property
    def judge(self) -> Referee:
        """Where the coordinator's own recomputations run (``referee-profile``): started at the first check."""
        return Referee.of(self.coord.settings.referee_profile)

    @property
    def own(self) -> str:
        """The compute profile the coordinator's recomputations declare."""
        return self.judge.profile

    def begin(self, replies: dict[str, Reply], checkers: Checkers | None) -> None:
        """The round's accepted replies (what each author declared) and its possible verifiers."""
        self.replies, self.checkers, self.evidence = replies, checkers, set()

    def __call__(self, t: int, rows: dict[str, tuple[Ticket, torch.Tensor]]) -> list[Verdict]:
        c, s = self.coord, self.coord.settings
        tasks = {author: Task.of(s, c.run_id, ticket.number, ticket.base) for author, (ticket, _) in rows.items()}
        seed = round_seed(s.seed, t, list(rows), [sha256(row) for _, row in rows.values()])
        asked: dict[str, tuple[str, RecordDict]] = {}
        momentum = any(ticket.start is not None for ticket, _ in rows.values())  # the coordinator holds the states
        if s.verifier == "nodes" and self.checkers is not None and not momentum:
            pool = [fp for fp in self.checkers.candidates if fp in c.keys and fp not in c.engine.flags.quarantined]
            for author, verifier in assign(seed, list(rows), pool).items():
                if verifier is not None:
                    content = task_content(tasks[author], rows[author][0].model.numpy(),
                                           (author, self.replies[author].part))
                    asked[author] = (verifier, content)
        answers = self.checkers.ask(asked) if asked else {}
        verdicts, disputed = [], {}
        for author, (ticket, row) in rows.items():
            task, w, declared = tasks[author], ticket.model, self.replies[author]
            work = {author: Dispute(author, author, task, w, declared.part, row, declared.root, declared.profile)}
            if author not in asked:
                verdict, differs = self._referee(task, w, author, row, start=ticket.start)
            else:
                verifier = asked[author][0]
                got = self._read(verifier, author, task, w.numel(), answers.get(author, "no reply before the deadline"))
                if isinstance(got, str):
                    verdict, differs = self._referee(task, w, author, row)
                    verdict.note = f"verifier {verifier[:12]} {got}; " + (verdict.note or "checked by the coordinator")
                else:
                    vrow, vreply = got
                    match, gap = compare(row, vrow, declared.profile == vreply.profile)
                    differs = declared.profile != vreply.profile and not torch.equal(row, vrow)
                    evidence = {"sha256": sha256(vrow), "signature": vreply.signature.hex(), "profile": vreply.profile,
                                **({"root": vreply.root} if vreply.root else {})}
                    work[verifier] = Dispute(verifier, author, task, w, declared.part, vrow, vreply.root, vreply.profile)
                    if not match:  # evidence: both signed rows are kept, whatever keep-updates says
                        self.evidence |= {keep_row(c.folder, vrow), keep_row(c.folder, row)}
                    verdict = (Verdict(author, verifier, gap) if match else
                               self._referee(task, w, author, row, verifier, (vrow, vreply.profile == self.own))[0])
                    verdict.check = evidence
            # a disagreement across profiles is a dispute, not a verdict; and a share of the checks
            # that passed across profiles with other bits are disputed too (``dispute-share``)
            for party in verdict.guilty:  # (a momentum row across profiles was refereed as one step already)
                if (party in work and work[party].profile != self.own and self.checkers is not None
                        and ticket.start is None):
                    disputed[author, party] = work[party]
            if (not verdict.guilty and differs and self.checkers is not None
                    and uniform(seed, "dispute", author) < s.dispute_share):
                disputed[author, author] = work[author]
            verdicts.append(verdict)
        if disputed:
            self._settle(verdicts, disputed)
        return verdicts

    def _settle(self, verdicts: list[Verdict], disputed: dict[tuple[str, str], Dispute]) -> None:
        """Referee the round's disputes (``nodes.coordinator.arbitration``) and let the rulings decide:
        a node cleared leaves its verdict's guilty, a node convicted joins it."""
        c = self.coord

        def keep(tensor: torch.Tensor) -> str:
            sha = keep_row(c.folder, tensor)
            self.evidence.add(sha)
            return sha

        rulings = arbitration.referee(disputed, self.checkers.ask, c.keys, self._part, c.codec, keep, self.judge)
        of = {v.author: v for v in verdicts}
        for (author, party), record in sorted(rulings.items()):
            verdict = of[author]
            verdict.disputes.append(record)
            if record["guilty"] and party not in verdict.guilty:
                verdict.guilty.append(party)
            elif not record["guilty"] and party in verdict.guilty:
                verdict.guilty.remove(party)
            said = f"dispute with {party[:12]}: {'convicted' if record['guilty'] else 'cleared'} ({record['reason']})"
            verdict.note = f"{verdict.note}; {said}" if verdict.note else said
            log.info("round %d: %s", c.engine.round + 1, said)

    def _part(self, part: str) -> NodeData:
        """Part ``part`` of the coordinator's data set, prepared once."""
        if part not in self._parts:
            self._parts[part] = part_of(self.coord.data, part)
        return self._parts[part]

    def _read(self, verifier: str, author: str, task: Task, d: int, content: RecordDict | str
              ) -> tuple[torch.Tensor, Reply] | str:
        """The verifier's signed recomputation, or why it cannot be used."""
        if isinstance(content, str):
            return content
        try:
            reply, row, _ = read_reply(content, d, self.coord.codec)
        except Exception as err:  # noqa: BLE001 - untrusted input: a reason, never an exception
            return f"sent an unreadable check ({str(err)[:120]})"
        if reply.refused:
            return f"could not check: {reply.refused[:200]}"
        if (reply.author, reply.run, reply.round, reply.base) != (author, task.run, task.round, task.base):
            return "answered another task"
        tensor = torch.from_numpy(row.copy())
        key = self.coord.keys.get(verifier)
        if key is None or not keys.verify(key, reply.signature, reply_payload(reply, sha256(tensor))):
            return "sent a badly signed check"
        if not bool(torch.isfinite(tensor).all()):
            return "sent a non-finite check"
        return tensor, reply

    def _referee(self, task: Task, w: torch.Tensor, author: str, row: torch.Tensor, verifier: str = SELF,
                 verifier_row: tuple[torch.Tensor, bool] | None = None, start: torch.Tensor | None = None
                 ) -> tuple[Verdict, bool]:
        """The coordinator's own recomputation of ``author``'s update decides; and whether the
        author's row differs from it bitwise, across profiles (to be disputed). ``start``: the
        momentum a ``momentum`` task named (``nodes.engine.states``): across profiles its row is
        refereed at once as the one step it is (``settle_step``)."""
        declared = self.replies[author]
        try:
            data = self._part(declared.part)
            if start is not None and declared.profile != self.own:
                ruling = self.judge.run(settle_step, task, w, start, row, data.x, data.y, data.classes, author,
                                        self.judge.device)
                return Verdict(author, verifier, ruling.gap, [author] if ruling.guilty else [],
                               f"one step across profiles: {ruling.reason}"), False
            raw, _ = self.judge.run(compute, task, w, data.x, data.y, data.classes, author, self.judge.device,
                                    "", start)
            codec = self.coord.codec
            honest = transmitted(codec, raw, (task.seed, task.round, author))
        except ValueError as err:
            return Verdict(author, verifier, None, [], f"cannot recompute: {str(err)[:200]}"), False
        same = declared.profile == self.own
        return (referee(author, row, same, honest, verifier, verifier_row, slack(codec, raw, honest)),
                not same and not torch.equal(row, honest))


def slack(codec: Codec, raw: torch.Tensor, sent: torch.Tensor) -> float:
    """What ``codec``'s rounding adds to the cross-profile bound (``nodes.engine.spotcheck``): twice its
    relative error on the recomputation ``raw`` (decoded: ``sent``); 0 for a sparse codec."""
    return 0.0 if codec.name == "none" or isinstance(codec, SparseCodec) else 2 * distance(sent, raw)
