"""A portable CPU profile: which settings give one x86 CPU's bits on another, and at what cost.

``python -m evaluation.portable [--json] [--repeats N] [--against FILE]`` runs a fixed set of
deterministic computations in a fresh process per candidate setting (a set of environment
variables, read once as PyTorch, MKL and oneDNN start) and records the SHA-256 of each result:

- ``mlp``, ``cnn``: the digits MLP's and CNN's updates under ``delta:steps=16`` (the disputes
  grid's task fields, ``evaluation.microbench.dispute_grid.task_fields``) for ``--nodes`` nodes
  on their parts, 1 thread, through the volunteers' own ``nodes.engine.training.compute``;
- ``matmul``: one float32 ``(256, 512) @ (512, 128)`` (MKL's SGEMM where PyTorch uses MKL);
- ``conv``: one ``conv2d`` forward and backward (oneDNN's kernels where PyTorch uses oneDNN).

Every input is portable by construction: integers from NumPy's PCG64 scaled by powers of two
(the base models too, at each layer's ``1/sqrt(fan_in)`` rounded to a power of two), and the
digits data set (integers standardised in float64 by NumPy). Their hashes are recorded
(``inputs``), so a difference between two machines is their kernels', never their inputs'.

The candidates: the machine's own choice (``uncapped``); PyTorch's and oneDNN's caps
(``isa=default|avx2|avx512``, as ``robust.profiles`` sets them), each alone, with MKL capped to
match (``MKL_ENABLE_INSTRUCTIONS``), with MKL's conditional numerical reproducibility at the
matching branch or at ``COMPATIBLE`` (``MKL_CBWR``), and three with oneDNN off
(``torch.backends.mkldnn``), where convolutions go to PyTorch's own im2col and MKL's GEMM. Each
process also says what it ran at: PyTorch's CPU capability, MKL's code path and CNR branch
(from MKL's verbose log) and oneDNN's ISA and convolution kernels (from oneDNN's).

Each setting's speed is the median of ``--repeats`` timed CNN and MLP tasks (and matmuls), the processes
taking turns, against ``uncapped`` measured in the same run: the task's CPU time (one thread, so
its wall time on an idle core; a busy shared machine changes the wall time, ``wall_ms``, far more
than the CPU time). ``--against FILE`` reads another
machine's ``--json`` output and says, per setting and computation, whether the two give the
same SHA-256: the cross-family test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from nodes.engine.training import compute, part_of
from robust.compute import profile
from robust.data import load
from robust.models import build_model
from robust.params import sha256, trained
from robust.profiles import Profile

from .dispute_grid import task_fields

ROOT = Path(__file__).resolve().parents[2]
COMPUTATIONS = ("mlp", "cnn", "matmul", "conv")
MODELS = ("cnn", "mlp")  # the computations that are a volunteer's task
TIMED = (*MODELS, "matmul")  # the matmul: what MKL's branch costs where the vector units are full
MATMULS = 50  # a matmul is timed over this many products (one takes well under a millisecond)
BASELINE = "uncapped"
# variables that change which kernels run or what they log: each child gets exactly its setting's
CONTROLLED = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
              "MKL_DEBUG_CPU_TYPE", "MKL_VERBOSE", "DNNL_VERBOSE", "ONEDNN_VERBOSE", "DNNL_DEFAULT_FPMATH_MODE",
              "ONEDNN_DEFAULT_FPMATH_MODE")
MKL_CAP = {"default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}  # MKL's names for the levels
FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


@dataclass(frozen=True)
class Setting:
    """A candidate: the profile's caps (``robust.profiles``), MKL's variables, oneDNN on or off."""

    name: str
    isa: str = "auto"
    mkl: dict = field(default_factory=dict)
    onednn: bool = True

    def env(self) -> dict[str, str]:
        """This environment without :data:`CONTROLLED`, then the setting's variables."""
        caps = Profile("cpu", self.isa).env()
        return {**{k: v for k, v in os.environ.items() if k not in CONTROLLED}, **caps, **self.mkl}

    def refusal(self) -> str | None:
        return Profile("cpu", self.isa).refusal()


def candidates() -> list[Setting]:
    """Every candidate setting, ``uncapped`` first (whether this CPU can run each: :meth:`Setting.refusal`)."""
    out = [Setting(BASELINE), Setting("cbwr=auto", mkl={"MKL_CBWR": "AUTO"}),
           Setting("cbwr=compatible", mkl={"MKL_CBWR": "COMPATIBLE"})]
    for isa, branch in MKL_CAP.items():
        name = f"isa={isa}"
        out += [Setting(name, isa), Setting(f"{name},mkl={branch.lower()}", isa, {"MKL_ENABLE_INSTRUCTIONS": branch}),
                Setting(f"{name},cbwr={branch.lower()}", isa, {"MKL_CBWR": branch}),
                Setting(f"{name},cbwr=compatible", isa, {"MKL_CBWR": "COMPATIBLE"})]
    out += [Setting(f"isa={isa},cbwr={branch.lower()},onednn=off", isa, {"MKL_CBWR": branch}, False)
            for isa, branch in (("default", "COMPATIBLE"), ("avx2", "COMPATIBLE"), ("avx2", "AVX2"))]
    return out


def machine() -> dict:
    """This CPU (``/proc/cpuinfo``), PyTorch's version, its BLAS and its own choice of level."""
    info = {}
    try:
        with open("/proc/cpuinfo") as lines:
            for line in lines:
                if not line.strip():
                    break  # the first processor says it for all
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", config)
    return {"vendor": info.get("vendor_id", platform.processor() or "unknown"),
            "model": info.get("model name", platform.machine()), "family": info.get("cpu family"),
            "model_number": info.get("model"), "flags": [f for f in FLAGS if f in info.get("flags", "").split()],
            "cores": os.cpu_count(), "torch": torch.__version__, "blas": blas[1] if blas else None,
            "mkl": "Math Kernel Library" in config, "capability": torch.backends.cpu.get_cpu_capability()}


# ---- the child: one setting's process ----------------------------------------------------------

def portable(seed: int, *shape: int, scale: float = 1.0):
    """A float32 tensor of ``shape`` any machine makes bit for bit: PCG64's integers in
    ``[-2^15, 2^15)`` times ``2^-15 * scale`` (``scale`` a power of two: exact)."""
    ints = np.random.default_rng(seed).integers(-2**15, 2**15, size=shape)
    return torch.from_numpy((ints * (2.0**-15 * scale)).astype(np.float32))


def base_model(name: str, shape: tuple[int, ...], classes: int):
    """``name``'s flat parameters, portable (:func:`portable`, each layer at ``1/sqrt(fan_in)``
    rounded to a power of two; a bias at its weight's)."""
    parts, scale = [], 1.0
    for i, (_, p) in enumerate(trained(build_model(name, shape, classes, 0))):
        if p.dim() > 1:
            scale = 2.0 ** -math.ceil(math.log2(math.sqrt(p[0].numel())))
        parts.append(portable(100 + i, p.numel(), scale=scale))
    return torch.cat(parts)


class _Work:
    """What a child computes, its inputs made once."""

    def __init__(self, nodes: int, steps: int) -> None:
        self.data = load("digits", seed=0)
        self.parts = [(f"node-{i:03d}", part_of(self.data, f"{i + 1}/{nodes}")) for i in range(nodes)]
        self.steps, self.bases = steps, {}
        # the matmul's two matrices; the convolution's input, weight, bias and output gradient
        self.operands = (portable(1, 256, 512), portable(2, 512, 128), portable(3, 16, 8, 12, 12),
                         portable(4, 16, 8, 3, 3, scale=2**-3), portable(5, 16), portable(6, 16, 16, 12, 12))

    def base(self, model: str):
        if model not in self.bases:
            self.bases[model] = base_model(model, self.data.shape, self.data.classes)
        return self.bases[model]

    def task(self, model: str, node: int):
        w = self.base(model)
        name, part = self.parts[node]
        task = SimpleNamespace(**task_fields(1, sha256(w), model, self.steps))  # threads: 1
        return compute(task, w, part.x, part.y, part.classes, name, torch.device("cpu"))[0]

    def run(self, what: str):
        """The result of computation ``what``, one flat float32 tensor."""
        if what in MODELS:
            return torch.cat([self.task(what, i) for i in range(len(self.parts))])
        a, b, x, w, bias, g = self.operands
        with profile(1):
            if what == "matmul":
                return a @ b
            x, w, bias = (t.detach().requires_grad_() for t in (x, w, bias))
            y = F.conv2d(x, w, bias, padding=1)
            (y * g).sum().backward()
            return torch.cat([t.detach().reshape(-1) for t in (y, x.grad, w.grad, bias.grad)])

    def inputs(self, computations) -> dict[str, str]:
        """The hashes of what the computations start from."""
        out = {m: sha256(self.base(m)) for m in MODELS if m in computations}
        if any(m in computations for m in MODELS):
            out["digits"] = sha256(torch.cat([torch.cat([p.x.reshape(-1), p.y.float()]) for _, p in self.parts]))
        if {"matmul", "conv"} & set(computations):
            out["operands"] = sha256(torch.cat([t.reshape(-1) for t in self.operands]))
        return out


def _captured(fn) -> tuple[object, str]:
    """``fn()``'s value and what the C libraries wrote to standard output meanwhile."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            value = fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return value, out.read().decode(errors="replace")


def effective(log: str) -> dict:
    """What the libraries say they ran, from MKL's and oneDNN's verbose ``log``."""
    path = re.search(r"MKL_VERBOSE oneMKL .*? for (?:Intel\(R\) 64 architecture )?(.*?), Lnx", log)
    return {"aten": torch.backends.cpu.get_cpu_capability(), "mkl_path": path[1] if path else None,
            "mkl_cnr": sorted(set(re.findall(r"CNR:(\S+)", log))),
            "onednn_isa": (re.findall(r"onednn_verbose,.*?,info,cpu,isa:(.*)", log) or [None])[0],
            "onednn_conv": sorted(set(re.findall(r"primitive,exec,cpu,convolution,([^,]+),", log)))}


def serve(answers: int) -> None:
    """The child's loop: JSON requests on standard input, one JSON answer a line on fd ``answers``."""
    out = os.fdopen(answers, "w")
    work = None

    def hashes(what):
        return {c: sha256(work.run(c)) for c in what}

    def logged(what):
        with torch.backends.mkl.verbose(1), torch.backends.mkldnn.verbose(1):
            return hashes(what)

    for line in sys.stdin:
        request = json.loads(line)
        torch.backends.mkldnn.enabled = request["onednn"]  # this process's own setting (its flags() warns)
        try:
            work = work or _Work(request["nodes"], request["steps"])
            if request["do"] == "run":  # once logged (what ran), once not: the two must agree
                first, log = _captured(lambda: logged(request["computations"]))
                again = hashes(request["computations"])
                answer = {"sha256": again, "stable": again == first, "effective": effective(log),
                          "inputs": work.inputs(request["computations"])}
            else:  # time one task of node 0 (1 thread: the task says so), or MATMULS products
                what = request["what"]
                times = 1 if what in MODELS else MATMULS
                once = (lambda: work.task(what, 0)) if what in MODELS else (lambda: work.run(what))
                began, cpu = time.perf_counter(), time.process_time()
                for _ in range(times):
                    once()
                answer = {"ms": (time.process_time() - cpu) * 1e3 / times,
                          "wall_ms": (time.perf_counter() - began) * 1e3 / times}
        except Exception as err:  # noqa: BLE001 - the parent reports it
            answer = {"error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


# ---- the parent ---------------------------------------------------------------------------------

class Child:
    """A process started with one setting's environment, and its pipes."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        read, write = os.pipe()
        code = "import sys; from evaluation.microbench.portable_profile import serve; serve(int(sys.argv[1]))"
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(write)], cwd=ROOT, env=self.setting.env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(write,), text=True)
        os.close(write)
        self.answers = os.fdopen(read)

    def ask(self, **request) -> None:
        self.proc.stdin.write(json.dumps({**request, "onednn": self.setting.onednn}) + "\n")
        self.proc.stdin.flush()

    def get(self) -> dict:
        line = self.answers.readline()
        if not line:
            raise RuntimeError(f"{self.setting.name}: its process ended (exit {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.setting.name}: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.answers.close()


def measure(names: list[str] | None = None, computations=COMPUTATIONS, repeats: int = 15, nodes: int = 3,
            steps: int = 16, progress=None) -> dict:
    """The measurement (see the module's docstring): ``names`` picks settings (default: every
    candidate this CPU can run), ``computations`` a subset of :data:`COMPUTATIONS`."""
    known = {s.name: s for s in candidates()}
    unknown = [n for n in names or () if n not in known]
    if unknown or not set(computations) <= set(COMPUTATIONS) or not computations:
        raise ValueError(f"settings {unknown} unknown (choose among {', '.join(known)})" if unknown else
                         f"computations {list(computations)}: choose among {', '.join(COMPUTATIONS)}")
    chosen = [known[n] for n in dict.fromkeys(names or known)]
    refused = {s.name: s.refusal() for s in chosen if s.refusal()}
    chosen = [s for s in chosen if s.name not in refused]
    timed = [m for m in TIMED if m in computations]
    children = []
    try:
        for s in chosen:
            children.append(Child(s))
        for child in children:  # the processes start and hash at once
            child.ask(do="run", computations=list(computations), nodes=nodes, steps=steps)
        runs = {child.setting.name: child.get() for child in children}
        ms, wall = defaultdict(list), defaultdict(list)
        for r in range(repeats):  # one process at a time computes, in turns, so each sees the same machine
            for child in children[r % len(children):] + children[:r % len(children)]:
                for model in timed:
                    child.ask(do="time", what=model, nodes=nodes, steps=steps)
                    took = child.get()
                    ms[child.setting.name, model].append(took["ms"])
                    wall[child.setting.name, model].append(took["wall_ms"])
            if progress:
                progress(r + 1, repeats)
    finally:
        for child in children:
            child.close()
    baseline = BASELINE if BASELINE in runs else next(iter(runs), None)
    settings = []
    for s in chosen:
        took = {m: median(ms[s.name, m]) for m in timed if ms[s.name, m]}
        settings.append({"name": s.name, "env": {k: v for k, v in s.env().items() if k in CONTROLLED},
                         "onednn": s.onednn, **runs[s.name], "ms": {m: round(t, 3) for m, t in took.items()},
                         "wall_ms": {m: round(median(wall[s.name, m]), 3) for m in took},
                         "relative": {m: round(t / median(ms[baseline, m]), 3) for m, t in took.items()}})
    return {"machine": machine(), "computations": list(computations), "nodes": nodes, "steps": steps,
            "threads": 1, "repeats": repeats, "baseline": baseline, "settings": settings, "refused": refused,
            "same": same_within(settings, computations)}


def same_within(settings: list[dict], computations) -> dict[str, list[list[str]]]:
    """Per computation, the settings grouped by the SHA-256 they gave (largest group first)."""
    out = {}
    for c in computations:
        groups = defaultdict(list)
        for s in settings:
            groups[s["sha256"][c]].append(s["name"])
        out[c] = sorted(groups.values(), key=len, reverse=True)
    return out


def compare(ours: dict, theirs: dict) -> dict:
    """Per setting both ran, per computation: ``same`` or ``different`` SHA-256 (``missing`` where
    one side lacks it); ``exact``: the settings equal on every computation both ran; ``levels``:
    per setting, what the libraries said they ran that differs (``here / there``: MKL falls back
    to its ``AUTO`` branch, silently, where a branch is not offered); ``caveats``: what differs in
    the runs themselves (inputs, task, PyTorch)."""
    other = {s["name"]: s for s in theirs.get("settings", [])}
    per, exact, caveats, levels = {}, [], [], {}
    for key in ("nodes", "steps"):
        if ours.get(key) != theirs.get(key):
            caveats.append(f"{key}: {ours.get(key)} here, {theirs.get(key)} there")
    if ours["machine"].get("torch") != theirs.get("machine", {}).get("torch"):
        caveats.append(f"torch {ours['machine'].get('torch')} here, {theirs.get('machine', {}).get('torch')} there")
    for s in ours["settings"]:
        t = other.get(s["name"])
        if t is None:
            per[s["name"]] = {c: "missing" for c in ours["computations"]}
            continue
        for key, value in s.get("inputs", {}).items():
            if t.get("inputs", {}).get(key, value) != value:
                caveats.append(f"{s['name']}: input {key} differs")
        mine, yours = s.get("effective", {}), t.get("effective", {})
        differ = [f"{k} {mine.get(k)} / {yours.get(k)}" for k in ("aten", "mkl_cnr", "onednn_conv")
                  if mine.get(k) != yours.get(k)]
        if differ:
            levels[s["name"]] = differ
        per[s["name"]] = {c: "missing" if c not in t.get("sha256", {}) else
                          "same" if t["sha256"][c] == s["sha256"][c] else "different" for c in ours["computations"]}
        if all(v == "same" for v in per[s["name"]].values()):
            exact.append(s["name"])
    return {"machine": theirs.get("machine", {}), "settings": per, "exact": exact, "levels": levels,
            "not_here": [n for n in other if n not in per], "caveats": sorted(set(caveats))}


def read_result(path: str) -> dict:
    """A ``--json`` run's object from ``path``: the file's last line that is a JSON object
    (its whole text as a fallback); ``ValueError`` says what was wrong."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"--against {path}: {err.strerror}") from None
    for candidate in [line for line in text.splitlines() if line.strip()][::-1] + [text]:
        try:
            found = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(found, dict) and isinstance(found.get("settings"), list) and "machine" in found:
            return found
    raise ValueError(f"--against {path}: no output of `python -m evaluation.portable --json` in it")


def describe(s: dict) -> str:
    """A setting's effective levels, short: PyTorch's, MKL's (its CNR branch) and oneDNN's
    convolutions (``off``: oneDNN off; ``-``: no convolution ran)."""
    e = s["effective"]
    path = e.get("mkl_path") or ""
    mkl = next((short for pattern, short in (("AVX-512", "avx512"), ("AVX2", "avx2"), ("AVX)", "avx"),
                                                ("SSE4.2", "sse4.2"), ("Architecture processors", "sse2"))
                if pattern in path), path[:24] or "-")
    cnr = [c for c in e.get("mkl_cnr", []) if c != "OFF"]
    conv = ",".join(c.replace("_core", "") for c in e.get("onednn_conv", [])) or ("-" if s["onednn"] else "off")
    return f"{e.get('aten', '?')} / mkl {mkl}{' cnr ' + ','.join(cnr).lower() if cnr else ''} / conv {conv}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.portable", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15, help="timed tasks per setting (the median is reported)")
    p.add_argument("--against", metavar="FILE", help="another machine's --json output: which SHA-256s are the same")
    p.add_argument("--settings", nargs="+", metavar="NAME",
                   help="candidate settings to run (default: every one this CPU can)")
    p.add_argument("--computations", nargs="+", default=list(COMPUTATIONS), choices=COMPUTATIONS)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    args = p.parse_args(argv)
    if min(args.repeats, args.nodes, args.steps) < 1:
        p.error("--repeats, --nodes and --steps must be at least 1")
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 250)
    try:
        theirs = read_result(args.against) if args.against else None
        result = measure(args.settings, args.computations, args.repeats, args.nodes, args.steps,
                         progress=lambda r, n: console.print(f"timed round {r}/{n}"))
    except ValueError as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    m = result["machine"]
    table = Table(title=f"{m['vendor']} {m['model']} (torch {m['torch']}, BLAS {m['blas']}, PyTorch's own level "
                        f"{m['capability']}): SHA-256 of each computation, CPU ms per task (1 thread)")
    for column in ("setting", "effective: aten / mkl / oneDNN conv", *result["computations"]):
        table.add_column(column)
    timed = [c for c in TIMED if c in result["computations"]]
    for c in timed:
        table.add_column(f"{c} ms", justify="right")
        table.add_column(f"x {result['baseline']}", justify="right")
    for s in result["settings"]:
        table.add_row(s["name"], describe(s), *(s["sha256"][c][:8] for c in result["computations"]),
                      *(text for c in timed for text in (f"{s['ms'][c]:.3g}", f"{s['relative'][c]:.2f}")))
    console.print(table)
    for name, why in result["refused"].items():
        console.print(f"{name}: not run ({why})")
    if theirs is not None:
        result["against"] = compare(result, theirs)
        a = result["against"]
        other = Table(title=f"against {a['machine'].get('vendor')} {a['machine'].get('model')} "
                            f"(torch {a['machine'].get('torch')}): the same SHA-256 on both machines?")
        for column in ("setting", *result["computations"]):
            other.add_column(column)
        for name, verdict in a["settings"].items():
            other.add_row(name, *(verdict[c] for c in result["computations"]))
        console.print(other)
        console.print(f"bit-exact on both machines, every computation: {', '.join(a['exact']) or 'none'}")
        for name, differ in a["levels"].items():
            console.print(f"{name} ran otherwise (here / there): {'; '.join(differ)}")
        if a["not_here"]:
            console.print(f"run there only: {', '.join(a['not_here'])}")
        for caveat in a["caveats"]:
            console.print(f"caveat: {caveat}")
    if args.json:
        print(json.dumps(result))
    return 0
