"""A training run's settings, declared once as data (``robust.constraints``).

``RUN`` is what a training run is (data, model, rule, protocol, flag policy, compute
profile): the coordinator's settings and the bench scenario's keys alike, checked by the
same rules. ``DEPLOY`` is what only a deployment has (network, deadlines, selection).
:class:`Settings` holds both: ``robust coordinator init`` writes them to
``DIR/coordinator.toml``, ``start`` options override them, the ServerApp reads them, and the
bench builds one per cell. A bad value fails before any process starts, in one line that
says what to change. Importing this module imports no torch (the CLI builds its options
from it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from pathlib import Path

from robust import profiles
from robust.constraints import Flag, Folder, Host, Interval, OneOf, Param, Spec, Text, check_all, table, unknown

SETTINGS_FILE = "coordinator.toml"
COORDINATOR = "coordinator"  # the coordinator folder inside a local federation's root (a demo's)


def coordinator_folder(folder: str | Path) -> Path:
    """The coordinator folder ``folder`` names: itself when it holds the settings, or its
    ``coordinator`` folder when it is a local federation's root (``robust demo --json``
    prints that root as ``folder``). Neither: a ``ValueError`` saying where one is expected."""
    folder = Path(folder)
    for candidate in (folder, folder / COORDINATOR):
        if (candidate / SETTINGS_FILE).is_file():
            return candidate
    raise ValueError(f"{folder} is not a coordinator folder: neither {folder / SETTINGS_FILE} nor "
                     f"{folder / COORDINATOR / SETTINGS_FILE} exists; give the DIR that `robust coordinator init DIR` "
                     f"made, or a demo's root")


def _datasets() -> list[str]:
    from robust.data import names

    return names()


def _text_set(spec: str) -> None:
    from robust.data import text_spec

    if text_spec(spec) is None:
        raise ValueError(f"{spec!r}: only a text set takes options (pystdlib:context=N,eval_bytes=B, text:context=N)")


def _models() -> tuple[str, ...]:
    from robust.models import MODELS

    return MODELS


def _gpt(spec: str) -> None:
    from robust.gpt import config

    config(spec)


def _aggregator(spec: str) -> None:
    import aggregators

    aggregators.build(spec, 0)  # names and parameters; n against f is checked with the quorum


def _staleness(spec: str) -> None:
    from .engine.staleness import weight_of

    weight_of(spec)


def _codec(spec: str) -> None:
    from robust import codecs

    codecs.build(spec)


def _device(choice: str) -> None:
    from robust.compute import resolve_device

    resolve_device(choice)  # cuda without a GPU: refused before any process starts


def _protocol(spec: str) -> None:
    from .engine.protocol import Protocol

    Protocol.parse(spec, lr=0.1, momentum=0.0, batch_size=1)


RUN = table(
    Param("seed", Interval(int, 0, None), 0, "run seed: the initial model, node selection, every node's batches"),
    Param("dataset", OneOf(_datasets, "load", _text_set, "pystdlib:context=256"), "digits",
          "the data set, or your loader package.module:load; volunteers must hold the same one"),
    Param("data-root", Text(), "", "folder of local files for mnist / fashion-mnist / cifar10 / hf-disk / text"),
    Param("model", OneOf(_models, "make", _gpt, "gpt:layers=2,width=64,heads=4,context=64"), "mlp",
          "the model, or your factory package.module:make (called as make(shape, classes))"),
    Param("code", Folder(), "", "a folder put first on the import path for your model and dataset; shipped to volunteers"),
    Param("rounds", Interval(int, 1, None), 5, "rounds to train (round = async: buffers aggregated)"),
    Param("aggregator", Spec(_aggregator, "an aggregator spec"), "trimmed-mean",
          "robust aggregator spec, e.g. nnm+trimmed-mean"),
    Param("tolerate", Interval(int, 0, None), 1, "f: Byzantine rows per round the aggregator must survive"),
    Param("quorum", Interval(int, 0, None), 0,
          "valid rows a round needs to step (0: the fewest the aggregator can serve)"),
    Param("protocol", Spec(_protocol, "a protocol spec"), "delta",
          "momentum (D-SGD, worker momentum) or delta:steps=K[,server_lr=,server_momentum=,nesterov=,inner=adamw,"
          "clip=] (local steps); gpt models default to delta:steps=4,inner=adamw,clip=1.0"),
    Param("batch-size", Interval(int, 1, None), 32, "samples per local step"),
    Param("lr", Interval(float, 0, None, "neither"), 0.05, "learning rate (gpt models default to 0.003)"),
    Param("momentum", Interval(float, 0, 1, "left"), 0.9, "worker momentum (momentum) or local SGD momentum (delta)"),
    Param("max-norm", Interval(float, 0, None, "neither"), 1000.0, "rows with a larger norm are rejected"),
    Param("flag-ratio", Interval(float, 1, None, "neither"), 4.0,
          "flag a row farther from the coordinate median than this x the run's typical distance (the largest "
          "round median of those distances so far)"),
    Param("flag-own", Flag(), True,
          "judge a row also against its node's own typical distance (the geometric mean of its unflagged rounds): "
          "a node that drifts slowly (outer momentum, 1-bit codecs) is not framed; false: the run's alone, which also "
          "catches label-flippers as they drift out late in training"),
    Param("quarantine-after", Interval(int, 1, None), 3, "flags (or rejections) before a node is no longer asked"),
    Param("false-alarm", Interval(float, 0, 1, "left"), 0.01,
          "evidence over rounds: quarantine a node whose update's direction stays atypical (a CUSUM), "
          "its threshold set for this chance that an honest node is ever quarantined over the run; "
          "0: per-round flags only"),
    Param("loss-evidence", Flag(), False,
          "evidence over rounds from the loss score as well (needs root = N and false-alarm > 0): quarantine a node "
          "whose rows keep raising the root samples' loss (a second CUSUM, sharing the false-alarm target); catches "
          "some label-flippers the geometry misses"),
    Param("root", Interval(int, 0, None), 0,
          "training samples the coordinator holds as its root data set, to compute its own update each round "
          "(fltrust needs it; 0: none)"),
    Param("spot-check", Interval(float, 0, 1), 0.0,
          "share of accepted updates recomputed from their task each round; a mismatch convicts (delta; momentum "
          "in sync rounds without compression)"),
    Param("round", OneOf(("sync", "async")), "sync",
          "sync: rounds with a deadline and a quorum; async: buffered asynchronous aggregation (FedBuff), "
          "every node kept busy, the rule run on every `buffer` valid replies"),
    Param("late", OneOf(("drop", "carry")), "drop",
          "sync: a reply after the round's deadline is dropped, or carried into the round it arrives in, weighted "
          "by its staleness (its node gets no new task meanwhile)"),
    Param("buffer", Interval(int, 0, None), 0, "async: valid replies per aggregation (0: half the nodes, at least the "
          "fewest the aggregator serves)"),
    Param("staleness", Spec(_staleness, "a staleness spec"), "sqrt",
          "async: a reply's weight by its staleness tau: constant, sqrt (1/sqrt(1+tau)) or poly:a=0.5"),
    Param("max-staleness", Interval(int, 0, None), 0, "async: replies staler than this are rejected (0: no limit)"),
    Param("lookahead", Flag(), True,
          "async: send each task the model extrapolated by the expected staleness (DANA) instead of the current one "
          "(no effect on sync rounds: their tasks are never stale; on by default: async reached its target 1.1-1.3x "
          "an all-fast federation's time with it, 1.4-1.6x without)"),
    Param("downlink", OneOf(("none", "fp16")), "none",
          "how the model travels to volunteers: none (float32), fp16 (half the bytes: nodes train from the model "
          "rounded to half precision, whose SHA-256 each task names)"),
    Param("compression", Spec(_codec, "a codec spec"), "none",
          "how updates travel: none, fp16, int8 (per-block scale), topk:k=0.01 (error feedback), randk:k=0.01"),
    Param("threads", Interval(int, 1, 1024), 1,
          "CPU threads of every computation whose bits matter: the same value gives the same bits on any core count"),
    Param("referee-profile", Spec(profiles.check, "a compute profile: cpu, cpu:isa=default|avx2|avx512 or cuda"), "cpu",
          "the compute profile of the coordinator's own recomputations (spot checks, disputes): cpu is its own "
          "process at this machine's best level; a capped level (cpu:isa=avx2) runs them in a process of its own, "
          "so that its checks of volunteers at that level are bit for bit; cuda on the GPU"),
    Param("device", Spec(_device, "auto, cpu or cuda"), "auto",
          "where the coordinator's rule and detectors run: cuda (deterministic, no TF32), cpu, or auto (cuda when "
          "torch sees a GPU); a run replays bit for bit on the device it ran on"),
)
DEPLOY = table(
    Param("per-round", Interval(int, 0, None), 0, "nodes asked per round (0: every online, admitted node)"),
    Param("deadline", Interval(float, 0, None, "neither"), 60.0, "seconds a node has to reply, from when its task leaves"),
    Param("wait-nodes", Interval(float, 0, None, "neither"), 120.0, "seconds to wait for a quorum of nodes to come online"),
    Param("max-count", Interval(int, 1, None), 1_000_000, "replies claiming more samples are rejected (counts are never weights)"),
    Param("rest-after", Interval(int, 1, None), 3,
          "rounds in a row a node may decline or not reply before it is rested (not asked) for as many rounds"),
    Param("verifier", OneOf(("nodes", "self")), "nodes",
          "who recomputes a spot-checked update: another volunteer (the coordinator referees a mismatch), or self"),
    Param("dispute-deadline", Interval(int, 1, None), 1,
          "a spot check that disagrees across compute profiles opens a dispute: the node shows the states of its "
          "committed trajectory and each step is refereed; it has this many rounds' deadlines to answer, and the "
          "round waits (an honest node's update still counts, a convicted one never does)"),
    Param("dispute-share", Interval(float, 0, 1), 0.0,
          "share of the cross-profile spot checks that pass the whole-update bound with different bits that are "
          "disputed anyway (refereed step by step: a forgery within the bound is caught too)"),
    Param("spool", OneOf(("auto", "memory", "disk")), "auto",
          "where a round's accepted updates wait for the rule: memory, or disk as they arrive (DIR/updates, "
          "read in column blocks, so memory does not grow with nodes x parameters); auto: disk past 1 GiB a round"),
    Param("in-flight", Interval(int, 0, None), 0,
          "tasks out at once (each reply waits in Flower until read), the rest sent as replies come back: "
          "0 (auto): as many as keep those replies under 2 GiB"),
    Param("keep-updates", OneOf(("all", "spot", "none")), "all",
          "accepted updates stored in DIR/updates for `robust audit verify`: all, the spot-checked ones, none"),
    Param("bind", Host(), "127.0.0.1", "address the SuperLink listens on (0.0.0.0 for other machines)"),
    Param("port", Interval(int, 1, 65535), 9190, "SuperLink port"),
)
PARAMS = {**RUN, **DEPLOY}


class _Checked:
    """Validation and files of :class:`Settings` (whose fields come from ``PARAMS``)."""

    def __post_init__(self) -> None:
        values = check_all("settings", PARAMS, {key: getattr(self, p.attr) for key, p in PARAMS.items()})
        for key, p in PARAMS.items():
            object.__setattr__(self, p.attr, values[key])
        from robust.user_code import is_reference, resolve, use_path
        from robust.data import LOADER
        from robust.models import FACTORY

        if self.code:
            use_path(self.code)
        for what, name, expected in (("model", self.model, FACTORY), ("dataset", self.dataset, LOADER)):
            if is_reference(name):
                resolve(name, what, expected)  # imports now: a typo fails before any process starts
        import aggregators
        from aggregators.base import NEEDED, ROOT_NEEDS

        try:
            chain = aggregators.build(self.aggregator, self.tolerate)
            if self.quorum:
                chain.check_n(self.quorum)
        except ValueError as err:
            raise ValueError(f"{err} [the quorum is {self.quorum}: raise quorum, or lower tolerate]") from None
        if chain.needs & ROOT_NEEDS and not self.root:
            what = " and ".join(NEEDED[k] for k in sorted(chain.needs & ROOT_NEEDS))
            raise ValueError(f"aggregator {self.aggregator!r} needs {what}, which the coordinator computes on clean "
                             "data it holds: set root = N (training samples, e.g. root=100)")
        if self.loss_evidence and not (self.root and self.false_alarm):
            raise ValueError(f"loss-evidence needs a root set and a false-alarm target (root = {self.root}, "
                             f"false-alarm = {self.false_alarm:g}): set root = N (e.g. root=100) and false-alarm > 0, "
                             "or loss-evidence = false")
        if self.spot_check and not self.protocol.startswith("delta"):
            if self.round == "async":
                raise ValueError(f"spot-check={self.spot_check:g} under protocol={self.protocol!r} needs round=sync: "
                                 "an asynchronous node gets its next task before its row is used, so no task could "
                                 "name the momentum it continues from: use round=sync, protocol=delta, or "
                                 "spot-check=0")
            if self.compression != "none":
                raise ValueError(f"spot-check={self.spot_check:g} under protocol={self.protocol!r} needs "
                                 f"compression=none (with {self.compression!r} the coordinator holds a rounded row, "
                                 "not the momentum a node continues from): use compression=none, protocol=delta, "
                                 "or spot-check=0")
        if self.spot_check:
            from robust import codecs

            if codecs.build(self.compression).biased:
                raise ValueError(f"spot-check={self.spot_check:g} cannot check compression={self.compression!r}: each "
                                 "update carries its node's error-feedback residual, which a verifier cannot "
                                 "recompute: use fp16, int8 or randk, or spot-check=0")
        if self.round == "async" and self.buffer and self.buffer < self.quorum_needed:
            raise ValueError(f"buffer={self.buffer} is below what the aggregator needs ({self.quorum_needed} rows): "
                             "raise buffer, or lower tolerate")
        if self.per_round and self.per_round < self.quorum_needed:
            raise ValueError(f"per-round={self.per_round} is below the quorum {self.quorum_needed}: "
                             "raise per-round or lower quorum")

    @property
    def stale_rows(self) -> bool:
        """Whether rows may come from older models (``round = async``, ``late = carry``): a late
        answer still counts, and rows' staleness is weighed and recorded."""
        return self.round == "async" or self.late == "carry"

    @property
    def asynchronous(self) -> bool:
        """Buffered asynchronous rounds (``round = async``)."""
        return self.round == "async"

    def buffer_for(self, nodes: int) -> int:
        """Valid replies per asynchronous aggregation among ``nodes`` that may be asked:
        ``buffer``, or if 0 half of them, at least the fewest the aggregator serves. Half, not
        the fewest: in the field lab (10 volunteers, 2 on 2 Mbit/s uplinks, ``trimmed-mean``
        serving 1) buffers of one never reached 90% (each step a lone reply, and one step per
        reply queued at the coordinator), buffers of five reached it 1.01-1.08x as late as the
        all-fast synchronous federation (docs: The field lab)."""
        return self.buffer or max(self.quorum_needed, math.ceil(nodes / 2))

    @functools.cached_property
    def quorum_needed(self) -> int:
        """Valid rows a round needs to step: ``quorum``, or if 0 the fewest the aggregator serves
        (kept once asked, and pickled with the settings: the coordinator's supervisor gets it
        from the child that checked them, without the rules' imports)."""
        if self.quorum:
            return self.quorum
        import aggregators

        return aggregators.build(self.aggregator, self.tolerate).least_n()

    @classmethod
    def of(cls, given: dict[str, object]) -> Settings:
        """The settings of the fields ``given`` (``None``: not given): what the model trains
        with by default (``robust.models.training_defaults``: a language model's local AdamW)
        fills the fields not given, the declared defaults the rest; validated."""
        from robust.models import training_defaults

        given = {k: v for k, v in given.items() if v is not None}
        model = given.get("model", PARAMS["model"].default)
        implied = {PARAMS[k].attr: v for k, v in training_defaults(str(model)).items()}
        return cls(**{**implied, **given})

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` (``None`` values ignored), validated."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_toml(self) -> str:
        lines = ["# robust coordinator settings: edit, or override with `robust coordinator start` options"]
        for p in PARAMS.values():
            value = getattr(self, p.attr)
            if isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = str(value).lower() if isinstance(value, bool) else repr(value)
            lines.append(f"{p.key} = {text}")
        return "\n".join(lines) + "\n"

    @classmethod
    def read(cls, folder: str | Path) -> Settings:
        path = Path(folder) / SETTINGS_FILE
        if not path.exists():
            raise ValueError(f"{path} not found: run `robust coordinator init {folder}` first")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML ({err}): fix it or run `robust coordinator init` in a new folder") from None
        unknown(raw, PARAMS, str(path))
        try:
            return cls(**{PARAMS[k].attr: v for k, v in raw.items()})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


Settings = dataclasses.make_dataclass(
    "Settings", [(p.attr, p.kind, dataclasses.field(default=p.default)) for p in PARAMS.values()],
    bases=(_Checked,), frozen=True,
)
Settings.__module__ = __name__
Settings.__doc__ = "A run's settings: one field per entry of ``PARAMS``, validated when built."
