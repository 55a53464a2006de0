"""Spot checks: recompute a random share of a round's updates from their tasks, convict liars.

Statistics catch a lie that looks different; recomputation catches one that looks normal
(BOINC validates by redundancy; BTARD, Gorbunov et al. 2022, recomputes peers' work from
public seeds). A volunteer's update is a function of its task (base model, protocol, its
partition, its batch draws keyed by its identity), so anyone holding the same data can
recompute it.

- **Draw.** Once a round's updates are committed (signed, accepted), the seed of the draw is
  the SHA-256 of those updates (:func:`round_seed`), which no node knows before it replies.
  Each update is checked with probability ``p`` (``spot-check``), independently: a node that
  lies every round is checked, hence convicted, after ``1/p`` rounds on average.
- **Compare.** :func:`compare`: bit for bit when the author and the recomputation declare the
  same compute profile (:func:`profile_of`: device, CPU instruction set or GPU, CPU model,
  torch version; the task fixes the thread count); otherwise the relative distance
  ``||u - r|| / ||r||`` must be at most :data:`TOLERANCE`.
- **Verdict.** A verifier (another volunteer, or the coordinator) recomputes; a match clears
  the update. On a disagreement, or when the verifier cannot answer, the coordinator
  recomputes itself and is the referee: whoever's signed row differs from its recomputation
  is convicted (the author for a fabricated update, the verifier for a false accusation), so
  a Byzantine verifier cannot convict an honest node. A convicted node is banned at once.
  Across profiles one number cannot tell rounding from a lie: there a disagreement opens a
  refereed dispute instead (``nodes.coordinator.arbitration``, settled step by step), whose ruling
  decides.

Calibration of :data:`TOLERANCE` (``python -m evaluation.spot_tolerance``, digits MLP and CNN, the
``delta`` protocol): honest recomputations with 1, 2 and 4 threads, and the bench's batched
kernels against a volunteer's, differ by a relative distance of at most ~1e-6; a forged
update scaled by 0.999 is 1e-3 away. The bound sits between, at 1e-4.

Compressed updates (``compression``): the author signed its *decoded* row, so a recomputation
is compared as it would have travelled (``nodes.engine.training.transmitted``: encoded with the
author's codec key, decoded). fp16, int8 and randk are deterministic functions of the row, so
on one profile the comparison stays bitwise. Across profiles two honest rows a ~1e-6 apart can
round to neighbouring codes, so the referee widens the bound by ``slack``: twice the codec's
own rounding error on its recomputation (fp16, int8; nothing for a sparse codec, which keeps
the same coordinates and rounds nothing). ``topk`` cannot be checked (its error-feedback
residual is the author's state): the settings refuse ``spot-check > 0`` with it.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache

import torch

from .ledger import Ticket

TOLERANCE = 1e-4  # relative L2 distance between two honest computations on different profiles
SELF = "coordinator"  # the verifier name of the coordinator's own recomputation


def round_seed(seed: int, round: int, ids: list[str], hashes: list[str]) -> bytes:
    """The draw's seed: a hash of the run seed, the round and every committed update."""
    h = hashlib.sha256(f"robust-spot/v1|{seed}|{round}".encode())
    for fp, sha in sorted(zip(ids, hashes)):
        h.update(f"|{fp}:{sha}".encode())
    return h.digest()


def uniform(seed: bytes, *parts: str) -> float:
    digest = hashlib.sha256(seed + "|".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def draw(seed: bytes, ids: list[str], p: float) -> list[str]:
    """The updates (by author) checked this round: each with probability ``p``."""
    return sorted(fp for fp in ids if uniform(seed, "draw", fp) < p)


def assign(seed: bytes, authors: list[str], candidates: list[str]) -> dict[str, str | None]:
    """A verifier for each author: a seeded choice among ``candidates`` that is not the author,
    spread so that no verifier gets a second check while another has none (``None``: nobody)."""
    load = dict.fromkeys(candidates, 0)
    out: dict[str, str | None] = {}
    for author in sorted(authors):
        pool = [c for c in candidates if c != author]
        out[author] = min(pool, key=lambda c: (load[c], uniform(seed, "verifier", author, c))) if pool else None
        if out[author] is not None:
            load[out[author]] += 1
    return out


@cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_of(device: torch.device) -> str:
    """What decides the bits of a computation besides its task: declared with every update."""
    if device.type == "cuda":
        hardware = f"cuda/{torch.cuda.get_device_name(device)}/cudnn-{torch.backends.cudnn.version()}"
    else:
        hardware = f"cpu/{torch.backends.cpu.get_cpu_capability()}/{_cpu_model()}"
    return f"{hardware}/torch-{torch.__version__}"


def distance(claimed: torch.Tensor, recomputed: torch.Tensor) -> float:
    """Relative L2 distance ``||claimed - recomputed|| / ||recomputed||`` (float64)."""
    a, b = claimed.to(torch.float64), recomputed.to(torch.float64)
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def compare(claimed: torch.Tensor, recomputed: torch.Tensor, same_profile: bool, slack: float = 0.0
            ) -> tuple[bool, float]:
    """``(match, relative distance)``: bitwise on the same profile, else within :data:`TOLERANCE`
    (plus ``slack``: a codec's rounding, see above)."""
    gap = distance(claimed, recomputed)
    return (torch.equal(claimed, recomputed) if same_profile else gap <= TOLERANCE + slack), gap


@dataclass
class Verdict:
    """The outcome of one check: who recomputed, how far the update was from the referee's
    recomputation, and who is convicted (empty: cleared)."""

    author: str
    verifier: str
    distance: float | None
    guilty: list[str] = field(default_factory=list)
    note: str = ""
    check: dict = field(default_factory=dict)  # the verifier's signed recomputation: sha256, signature, profile
    disputes: list[dict] = field(default_factory=list)  # the rulings of its disputes (nodes.coordinator.arbitration)

    def record(self) -> dict:
        return {"author": self.author, "verifier": self.verifier, "distance": self.distance,
                "guilty": self.guilty, "note": self.note, "check": self.check,
                **({"disputes": self.disputes} if self.disputes else {})}


# (round, {author: (the task its row answers, its committed row)}) -> verdicts: the
# coordinator's, the bench's, or a log's replay; each row is recomputed from its own task
Verifier = Callable[[int, dict[str, tuple[Ticket, torch.Tensor]]], list[Verdict]]


def referee(author: str, row: torch.Tensor, same_profile: bool, honest: torch.Tensor, verifier: str = SELF,
            verifier_row: tuple[torch.Tensor, bool] | None = None, slack: float = 0.0) -> Verdict:
    """The verdict on ``author``'s ``row`` from the referee's ``honest`` recomputation
    (``same_profile``: the author declared the referee's profile); with a disagreeing verifier's
    ``(row, same profile)``, the verifier too is convicted if its row differs from ``honest``.
    ``slack``: what a codec's rounding adds to the cross-profile bound."""
    match, gap = compare(row, honest, same_profile, slack)
    guilty = [] if match else [author]
    if verifier_row is not None and not compare(verifier_row[0], honest, verifier_row[1], slack)[0]:
        guilty.append(verifier)
    return Verdict(author, verifier, gap, guilty, "refereed by the coordinator" if verifier != SELF else "")


def recorded(spot: Mapping[int, list[dict]]) -> Verifier:
    """A verifier that gives the verdicts a run recorded (``round -> records``): the audit's
    replay of a log, which cannot re-run the volunteers' training."""

    def verify(round: int, rows: dict[str, tuple[Ticket, torch.Tensor]]) -> list[Verdict]:
        return [Verdict(r["author"], r["verifier"], r["distance"], list(r["guilty"]), r["note"], dict(r["check"]),
                        list(r.get("disputes", []))) for r in spot.get(round, [])]

    return verify
