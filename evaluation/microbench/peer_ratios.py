"""``robust agg-bench --peers``: per rule, robust's time beside its peers', and issue 41's targets.

One row per rule: the median ms of robust's rule, of ByzFL's equivalent and of Flower's fastest
(all timed in turns on the same input), the fastest peer, and the ratio fastest peer ms /
robust ms (above 1: robust is faster). Issue 41's targets are such ratios at n = 100,
d = 1e6, f = 20, float32 (:data:`TARGET_RATIOS`); a row of that size says ``ok`` or ``MISSED``.
A rule that reads exact distances is also timed against its floor, one float64 Gram pass
(``evaluation.peers.gram_pass``): its row adds the rule's time as a multiple of it.
"""

from __future__ import annotations

TARGET_SIZE = (100, 1_000_000, "float32")  # n, d, dtype; f = n // 5 = 20
TARGET_RATIOS = {"krum": 2.0, "multi-krum": 2.0, "centered-clipping": 5.0, "geometric-median": 5.0,
                 "median": 4.0, "trimmed-mean": 4.0}
PEERS = {"byzfl": "ByzFL", "flower": "Flower"}  # a method's kind -> its column


def compared(ours: dict, peers: list[dict], order: list[str], dtype: str) -> dict:
    """The rule's row from its methods' records (``ours``, then the peers'; each with
    ``kind``, ``method`` and ``ms``) and the order the methods were called in."""
    row = {"kind": "peers", "rule": ours["rule"], "n": ours["n"], "d": ours["d"], "f": ours["f"], "dtype": dtype,
           "robust_ms": ours["ms"], "order": order}
    for kind in PEERS:
        times = [r["ms"] for r in peers if r["kind"] == kind]
        row[f"{kind}_ms"] = min(times) if times else None
    for floor in (r for r in peers if r["kind"] == "floor"):  # not a peer: the products alone
        row["gram_ms"], row["x_gram"] = floor["ms"], ours["ms"] / floor["ms"]
    peers = [r for r in peers if r["kind"] in PEERS]
    fastest = min(peers, key=lambda r: r["ms"], default=None)
    row["fastest_peer"] = None if fastest is None else fastest["method"]
    row["ratio"] = None if fastest is None else fastest["ms"] / ours["ms"]
    if (row["n"], row["d"], dtype) == TARGET_SIZE and row["rule"] in TARGET_RATIOS and fastest is not None:
        row["target_ratio"] = TARGET_RATIOS[row["rule"]]
        row["met"] = row["ratio"] >= row["target_ratio"]
    return row


def print_header() -> None:
    print(f"{'size':<13} {'rule':<28} {'robust ms':>10} {'ByzFL ms':>10} {'Flower ms':>10} {'ratio':>7} "
          f"{'target':>11}  fastest peer")


def print_row(row: dict) -> None:
    """Print a rule's row (:func:`compared`); the methods' own records are the JSON's only."""
    if row["kind"] != "peers":
        return
    ms = [f"{row[k]:>10.1f}" if row[k] is not None else f"{'-':>10}" for k in ("robust_ms", "byzfl_ms", "flower_ms")]
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
    target = f"{row['target_ratio']:g}x {'ok' if row['met'] else 'MISSED'}" if "target_ratio" in row else ""
    floor = f"; {row['x_gram']:.2f}x one float64 Gram pass ({row['gram_ms']:.1f} ms)" if "gram_ms" in row else ""
    print(f"{row['n']:>4}x{row['d']:<8} {row['rule']:<28} {' '.join(ms)} {ratio:>7} {target:>11}  "
          f"{row['fastest_peer'] or '-'}{floor}", flush=True)
