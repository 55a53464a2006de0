"""The audit chain: every round's record hash-chained, every accepted update stored and signed.

Each line of ``rounds.jsonl`` carries ``prev``, the SHA-256 of the previous line's bytes (the
first: of ``robust-audit/v1|<run id>``), and ``updates``: for every update the round used or
convicted, its SHA-256, its author's signature, sample count, data part and compute
profile. The updates themselves are stored content-addressed, ``DIR/updates/<sha256>.npy``
(``keep-updates``: all, only the spot-checked and convicted ones, or none).

:func:`verify` (``robust audit verify DIR``) checks the chain (and its last link against the
checkpoint), every signature, every stored update's hash, and recomputes every round
through the round engine itself from the stored updates and the recorded spot-check
verdicts, comparing the recomputed record (aggregate and model SHA-256, accuracy, flags)
bit for bit. The replay is exact on the machine that ran the round (or one with the same
CPU and software stack: aggregation rules use BLAS products).

Asynchronous runs (``round = async``): each round is a buffer; its record's ``staleness`` (how
many versions behind each update's base model was) is the schedule the engine replays, and
each update entry also names the task it answered and its base model (``task``, ``base``),
which its signature covers and which must be the logged model of the version its staleness
names. ``robust coordinator replay DIR`` runs the same recomputation without the chain and
signature checks (:func:`replay_main`).

Compressed runs (``compression``) store each kept update at the codec's size: the arrays the
node sent, as they were checked (``DIR/updates/<sha256>.npz``; an int8 run stores a quarter
of the float32 bytes, a sign run a 32nd). A node signs the SHA-256 of its *decoded* row, and
that hash names the file: the audit decodes each stored encoding with the run's codec (the
same checked, deterministic decode the round used), checks the decoded row against the hash
its author signed, and replays the aggregation from exactly the rows the rounds used, one
round's decoded rows at a time in a scratch folder beside the run. Rows kept as evidence of
a spot-check mismatch (the verifier's recomputation and the row it contradicts) stay float32
``.npy``: either form is read wherever a stored update is.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import torch

from robust import codecs, keys
from robust.codecs import Codec, Encoded
from robust.data import load
from robust.models import build_model
from robust.params import sha256
from robust.rowstore import RowStore, names
from robust.source import Spooled, write_row

from .. import checkpoint
from ..engine.engine import Engine, replay_note
from ..engine.ledger import Ticket
from ..engine.root import Root
from ..engine.spotcheck import recorded
from ..settings import Settings, coordinator_folder
from ..engine.training import part_of
from ..wire import Task, signed_payload
from . import arbitration
from .roundlog import chain, line_hash
from .admission import known_keys
from .arbitration import Dispute, Referee

UPDATES = "updates"
STATE = "state"  # the rule's rows carried across rounds, when the run spooled (robust.rowstore)
log = logging.getLogger(__name__)
COMPARED = ("ids", "rejected", "failed", "missing", "flagged", "quarantined", "skipped", "accuracy",
            "model_sha256", "aggregate_sha256", "spot", "convicted", "scores", "staleness", "task_sha256")


def row_path(folder: Path, sha: str) -> Path:
    """Where the float32 update of SHA-256 ``sha`` is stored."""
    return Path(folder) / UPDATES / f"{sha}.npy"


def encoding_path(folder: Path, sha: str) -> Path:
    """Where the encoding (a compressed run's arrays, as sent) of the update ``sha`` is stored."""
    return Path(folder) / UPDATES / f"{sha}.npz"


def update_path(folder: Path, update: torch.Tensor | Encoded, sha: str) -> Path:
    """Where the update ``sha`` is stored in the form it came in: a float32 row, or a codec's arrays."""
    return (row_path if isinstance(update, torch.Tensor) else encoding_path)(folder, sha)


def keep(folder: Path, update: torch.Tensor | Encoded, sha: str) -> Path:
    """Store the update of SHA-256 ``sha`` (a float32 row, or the arrays a node sent), once; the file."""
    if isinstance(update, torch.Tensor):
        return _write_once(row_path(folder, sha), lambda out: write_row(out, update))
    return _write_once(encoding_path(folder, sha), lambda out: np.savez(out, **update))


def keep_row(folder: Path, row: torch.Tensor, sha: str | None = None) -> str:
    """Store ``row`` under its SHA-256 (``sha``, if already known), once; return the hash."""
    sha = sha or sha256(row)
    keep(folder, row, sha)
    return sha


def _write_once(path: Path, write) -> Path:
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        checkpoint.write_atomic(path, write)
    return path


def store(folder: Path, keep: str, record: dict, inbox, evidence: set[str] = frozenset()) -> dict:
    """The round's ``updates`` entry (every row it used or convicted, with what its author
    signed); the updates ``keep`` says to keep go to ``DIR/updates`` at the codec's size, and
    the files the round spooled there (``inbox.spooled``) that it does not keep are removed
    (``evidence``: the SHA-256 of rows a spot-check mismatch stored, which stay)."""
    checked = {v["author"] for v in record["spot"]}
    used = sorted(set(record["ids"]) | (set(record["convicted"]) & set(inbox.rows)))
    out, kept = {}, {row_path(folder, sha) for sha in evidence}
    for fp in used:
        reply, sha = inbox.replies[fp], inbox.hashes[fp]
        if keep == "all" or (keep == "spot" and fp in checked):
            kept.add(_keep(folder, inbox, fp))
        out[fp] = {"sha256": sha, "signature": reply.signature.hex(), "count": reply.count, "part": reply.part,
                   "profile": reply.profile, **({"root": reply.root} if reply.root else {})}
        if "staleness" in record:  # rows may be stale: the task each answered, and the model it was computed from
            out[fp].update(task=reply.round, base=reply.base)
    for path in inbox.spooled - kept:
        path.unlink(missing_ok=True)
    return out


def _keep(folder: Path, inbox, fp: str) -> Path:
    """Store node ``fp``'s update at the codec's size (its encoding, if it came encoded; a
    spooled one is there already); the file it is kept in."""
    update = inbox.encoded.get(fp, inbox.rows[fp])
    return update if isinstance(update, Path) else keep(folder, update, inbox.hashes[fp])


def _row(folder: Path, sha: str, codec: Codec, d: int, scratch: Path) -> Path | str:
    """The stored update of SHA-256 ``sha`` as a float32 row file (its own, or its encoding
    decoded into ``scratch``), once its values are checked against ``sha`` block by block:
    the replay reads it from disk, never the round's rows all in memory; or what is wrong."""
    path = row_path(folder, sha)
    if not path.exists() and encoding_path(folder, sha).exists():
        path = encoding_path(folder, sha)
        try:
            with np.load(path, allow_pickle=False) as npz:
                row = codec.decode({name: npz[name] for name in npz.files}, d)
        except Exception as err:  # noqa: BLE001 - a damaged file is a finding, not a crash
            return f"{path.relative_to(folder)} does not decode with {codec.spec} ({str(err)[:120]})"
        if sha256(row) != sha:
            return f"{path.relative_to(folder)} does not match its SHA-256 (changed)"
        decoded = scratch / f"{sha}.npy"
        write_row(decoded, row)
        return decoded
    if not path.exists():
        return f"{path.relative_to(folder)} is missing"
    try:
        actual = Spooled([path]).sha256s()[0]
    except Exception as err:  # noqa: BLE001 - a damaged file is a finding, not a crash
        return f"{path.relative_to(folder)} does not load ({type(err).__name__})"
    return path if actual == sha else f"{path.relative_to(folder)} does not match its SHA-256 (changed)"


def _replay_store(engine: Engine, folder: Path, scratch: Path) -> RowStore | None:
    """Where the replay's rule keeps its rows across rounds: like the run's, on disk when the run
    kept them there (``DIR/state``), in ``scratch`` (a folder of the replay's own on the run's
    disk, removed with it); ``None``: in memory."""
    if not (folder / STATE).exists():
        return None
    store = RowStore(scratch)
    engine.chain.spill(store)
    return store


def verify(folder: str | Path, full: bool = True) -> tuple[list[str], int, bool]:
    """``(problems, rounds checked, aggregation recomputed)`` for the run in ``folder``.

    ``full`` (``robust audit verify``): the hash chain, its last link against the checkpoint,
    every signature, then the recomputation. Without (``robust coordinator replay``): the
    recomputation alone. Either way, the same replay: every round (an asynchronous run's
    buffer) through the round engine from the stored updates, with each record's
    ``staleness`` (an async round's schedule: each update's recorded base must be the model
    of the version its staleness names), compared with the log bit for bit."""
    folder = Path(folder)
    settings = Settings.read(folder)
    word = "buffer" if settings.round == "async" else "round"
    run_id = (folder / checkpoint.RUN_ID).read_text().strip()
    log_bytes = (folder / checkpoint.ROUNDS).read_bytes() if (folder / checkpoint.ROUNDS).exists() else b""
    records, broken, tip = chain(run_id, log_bytes, word)
    if len(records) < len(log_bytes.splitlines()):
        return [broken[-1][1]], len(records), False
    problems = [problem for _, problem in broken] if full else []
    state = checkpoint.load(folder) if records and full else None
    if state is not None and line_hash(state["record"]) != tip:
        problems.append(f"{word} {len(records)}: its record differs from the checkpoint's ({checkpoint.ROUNDS} "
                        f"line {len(records)} changed)")
    data = load(settings.dataset, root=settings.data_root or None, seed=0)
    spot = {r["round"]: r.get("spot", []) for r in records}
    engine = Engine(settings, build_model(settings.model, data.shape, data.classes, settings.seed), data.x_test,
                    data.y_test, verifier=recorded(spot) if settings.spot_check else None, root=Root.of(settings, data))
    note = replay_note(records, engine.device)  # a run on a GPU, replayed on a CPU: said once, and with any mismatch
    if note:
        log.warning(note)
    signers = known_keys(folder) if full else {}
    judge = cache(lambda: Referee.of(settings.referee_profile))  # started at the first dispute
    # models[v]: the logged model the tasks of version v carried (extrapolated by lookahead,
    # rounded by the downlink): what the updates of the next round (or buffers) were computed from
    replay, base = True, engine.task_model()[1]
    models = [base]
    codec, d = codecs.build(settings.compression), engine.w.numel()
    with tempfile.TemporaryDirectory(prefix=".replay-", dir=folder) as tmp:  # decoded encodings, the rule's rows
        decoded_rows = Path(tmp) / "decoded"
        decoded_rows.mkdir()
        store = _replay_store(engine, folder, Path(tmp) / STATE)
        for r in records:
            t, updates = r["round"], r.get("updates", {})
            staleness = r.get("staleness")
            for fp, u in updates.items():
                if "base" in u:  # async: computed from an older model, which the schedule names
                    tau = (staleness or {}).get(fp)
                    v = None if tau is None else t - 1 - tau
                    if v is None or not 0 <= v < len(models) or models[v] != u["base"]:
                        problems.append(f"{word} {t}: {fp[:12]}'s update is based on model {str(u['base'])[:12]}, "
                                        f"not the model of the version its staleness {tau} names ({checkpoint.ROUNDS} "
                                        f"line {t} changed)")
                if not full:
                    continue
                payload = signed_payload(run_id, u.get("task", t), u.get("base", base), u["sha256"], u["count"],
                                         u["part"], u["profile"], root=u.get("root", ""))
                if fp not in signers or not keys.verify(signers[fp], bytes.fromhex(u["signature"]), payload):
                    problems.append(f"{word} {t}: the signature of {fp[:12]}'s update does not verify")
            for v in r.get("spot", []) if full else []:
                c = v.get("check") or {}
                author = updates.get(v["author"], {})
                payload = signed_payload(run_id, author.get("task", t), author.get("base", base), c.get("sha256"), 0,
                                         author.get("part", ""), c.get("profile"), v["author"], c.get("root", ""))
                if c and (v["verifier"] not in signers
                          or not keys.verify(signers[v["verifier"]], bytes.fromhex(c["signature"]), payload)):
                    problems.append(f"{word} {t}: the signature of {v['verifier'][:12]}'s check does not verify")
            base = r.get("task_sha256", r.get("model_sha256"))  # what the next round's updates were computed from
            models.append(base)
            for decoded in decoded_rows.iterdir():  # the last round's decoded rows: one round on disk at a time
                decoded.unlink()
            rows = {fp: _row(folder, u["sha256"], codec, d, decoded_rows) for fp, u in updates.items()}
            bad = {fp: why for fp, why in rows.items() if isinstance(why, str)}
            if bad:
                if settings.keep_updates == "all" or any("missing" not in why for why in bad.values()):
                    problems.extend(f"{word} {t}: {why}" for why in bad.values())
                replay = False
            if not replay:
                continue
            ids = sorted(rows)
            if staleness is not None and not set(ids) <= set(staleness):
                unnamed = ", ".join(fp[:12] for fp in sorted(set(ids) - set(staleness)))
                problems.append(f"{word} {t}: the record gives no staleness for {unnamed} ({checkpoint.ROUNDS} "
                                f"line {t} changed)")
                staleness = {fp: int(staleness.get(fp, 0)) for fp in ids}
            # the schedule: each row's task, at the version its staleness names (its model is not
            # needed: the spot checks' verdicts are the log's)
            tasks = {fp: Ticket(fp, int(updates[fp].get("task", t)), t - 1 - int((staleness or {}).get(fp, 0)),
                                str(updates[fp].get("base", models[t - 1])), None) for fp in ids}
            X = Spooled([rows[fp] for fp in ids], shas=[updates[fp]["sha256"] for fp in ids]) if ids \
                else torch.empty(0, engine.w.numel())
            if full:  # every dispute refereed again, from the model the round's tasks carried
                problems.extend(f"{word} {t}: {why}" for why in _disputes(
                    folder, settings, run_id, r, engine.task_model()[0], data, codec, signers, judge))
            convicted = set(r["convicted"])
            rejected = {fp: why for fp, why in r["rejected"].items() if fp not in convicted}
            asked = sorted(set(ids) | set(r["rejected"]) | set(r["failed"]) | set(r["missing"]))
            again = checkpoint.finite(engine.step(asked, ids, X, rejected, r["failed"], tasks=tasks))
            if store is not None:
                store.collect(names(engine.chain.state()))
            changed = [key for key in COMPARED if again.get(key) != r.get(key)]
            if changed:
                problems.append(f"{word} {t}: recomputed {', '.join(changed)} differ(s) from the log "
                                f"({checkpoint.ROUNDS} line {t} or its updates changed{'; or ' + note if note else ''})")
    return problems, len(records), replay


def _disputes(folder: Path, settings: Settings, run_id: str, r: dict, w: torch.Tensor, data, codec: Codec,
              signers: dict, judge: Callable[[], Referee]) -> list[str]:
    """What does not hold of round ``r``'s disputes (``nodes.coordinator.arbitration.audit``), its
    tasks having carried ``w``; refereed again by ``judge()`` (at the run's ``referee-profile``)."""
    problems, updates = [], r.get("updates", {})

    def load(sha: str) -> torch.Tensor | str:
        path = row_path(folder, sha)
        try:
            kept = torch.from_numpy(np.load(path, allow_pickle=False))
        except Exception:  # noqa: BLE001 - a missing or damaged file is a finding, not a crash
            return f"{path.relative_to(folder)}, a dispute's evidence, is missing or damaged"
        return kept if sha256(kept) == sha else f"{path.relative_to(folder)} does not match its SHA-256 (changed)"

    for v in r.get("spot", []):
        u = updates.get(v["author"], {})
        task = Task.of(settings, run_id, int(u.get("task", r["round"])), str(u.get("base", sha256(w))))
        for record in v.get("disputes", []):
            d = Dispute(str(record.get("node")), v["author"], task, w, str(u.get("part", "")), w, "", "")
            current = task.base == sha256(w)  # an async buffer's stale task: its model is not the replay's
            why = arbitration.audit(record, d, signers.get(d.signer), load, part_of(data, d.part), codec,
                                    judge() if current else None)
            if why:
                problems.append(f"the dispute with {d.signer[:12]} over {v['author'][:12]}'s update: {why}")
    return problems


def main(folder: str | Path) -> int:
    """``robust audit verify DIR`` (a coordinator folder, or a demo's root): print the findings;
    0 when everything holds."""
    folder = coordinator_folder(folder)
    problems, rounds, replayed = verify(folder)
    for problem in problems:
        print(f"FAILED {problem}")
    if problems:
        print(f"{len(problems)} problem(s) in {rounds} round(s) of {folder}")
        return 1
    print(f"{rounds} rounds verified: chain, signatures"
          + (", every aggregation recomputed bit for bit" if replayed else
             "; aggregation not recomputed (updates not kept: keep-updates)"))
    return 0


def replay_main(folder: str | Path) -> int:
    """``robust coordinator replay DIR`` (a coordinator folder, or a demo's root): :func:`verify`'s
    recomputation alone (no chain, no signatures: ``robust audit verify`` checks those too); 0
    when every model SHA-256 matches."""
    folder = coordinator_folder(folder)
    problems, rounds, replayed = verify(folder, full=False)
    word = "buffers" if Settings.read(folder).round == "async" else "rounds"
    for problem in problems:
        print(f"MISMATCH {problem}")
    if not replayed and not problems:
        problems = [f"the updates are not kept (keep-updates): nothing to replay"]
        print(f"MISMATCH {problems[0]}")
    if problems:
        print(f"{len(problems)} problem(s) in {rounds} {word} of {folder}")
        return 1
    print(f"{rounds} {word} replayed: every model SHA-256 matches")
    return 0
