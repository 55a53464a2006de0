"""Compute profiles: the hardware and kernel level a computation runs at, as a spec.

Two honest machines give different bits for one task when their kernels differ: a GPU and a
CPU, and also two x86 CPUs that PyTorch dispatches to different instruction sets (its
``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512``) and oneDNN runs at different levels
(``DNNL_MAX_CPU_ISA``). One machine emulates such a crowd by running each profile in a process
of its own started with those variables, which PyTorch reads once, when it starts.

Specs use the project's grammar:

- ``cpu:isa=default|avx2|avx512,threads=N`` (``isa`` left out: what the machine picks);
- ``cuda``: the GPU, deterministic algorithms, no TF32 (``robust.compute.profile``).

:meth:`Profile.env` is what a process of the profile is started with, :meth:`Profile.refusal`
why this machine cannot run it (a level its CPU lacks, a GPU it does not have), and
:func:`effective` the level PyTorch runs at in this process, which records name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from .constraints import Interval, OneOf, Param, check_all, table
from .spec import parse

ISAS = ("default", "avx2", "avx512")
# the CPU flags a level needs (Linux /proc/cpuinfo names), and oneDNN's name for the same cap
NEEDS = {"default": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}
DNNL = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE"}
PARAMS = {
    "cpu": table(
        Param("isa", OneOf(ISAS + ("auto",)), "auto", "the instruction set PyTorch and oneDNN may use (auto: the machine's best)"),
        Param("threads", Interval(int, 1, 1024), 1, "intra-op CPU threads"),
    ),
    "cuda": {},
}


@cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Profile:
    kind: str  # cpu | cuda
    isa: str = "auto"
    threads: int = 1

    @classmethod
    def parse(cls, spec: str) -> Profile:
        """The profile ``spec`` names; ``ValueError`` says what to write."""
        parts = parse(spec)
        if len(parts) != 1 or parts[0].name not in PARAMS:
            raise ValueError(f"profile {spec!r}: write cpu (with isa=default|avx2|avx512, threads=N) or cuda, "
                             "e.g. cpu:isa=avx2,threads=2")
        kind = parts[0].name
        return cls(kind, **check_all(f"profile {kind}", PARAMS[kind], parts[0].params))

    @property
    def spec(self) -> str:
        if self.kind == "cuda":
            return "cuda"
        return "cpu:" + ",".join(([f"isa={self.isa}"] if self.isa != "auto" else []) + [f"threads={self.threads}"])

    def prefix(self) -> list[str]:
        """A command prefix that starts a process with :meth:`env` (``env K=V ...``; none for none)."""
        return ["env", *(f"{k}={v}" for k, v in self.env().items())] if self.env() else []

    def env(self) -> dict[str, str]:
        """The environment a process of this profile starts with (read by PyTorch at import)."""
        if self.kind == "cuda" or self.isa == "auto":
            return {}
        return {"ATEN_CPU_CAPABILITY": self.isa, "DNNL_MAX_CPU_ISA": DNNL[self.isa]}

    def refusal(self) -> str | None:
        """Why this machine cannot run the profile, in one line (``None``: it can)."""
        if self.kind == "cuda":
            import torch

            return None if torch.cuda.is_available() else "profile cuda: torch sees no GPU on this machine"
        missing = [f for f in NEEDS.get(self.isa, ()) if f not in cpu_flags()]
        if missing and cpu_flags():
            return (f"profile {self.spec}: this CPU lacks {', '.join(missing)}; "
                    f"choose isa={'avx2' if self.isa == 'avx512' and 'avx2' in cpu_flags() else 'default'}")
        return None


def check(spec: str) -> None:
    """``ValueError`` for a profile spec that is malformed or that this machine cannot run (a
    settings and scenario rule: refused before any process starts)."""
    reason = Profile.parse(spec).refusal()
    if reason:
        raise ValueError(reason)


def effective() -> str:
    """The level PyTorch runs at in this process (``DEFAULT``, ``AVX2``, ``AVX512``...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()
