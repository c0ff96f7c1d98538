"""The colocated section of ``BENCHMARKS.md``, its targets and ``colocated.png`` (results of
:func:`bench.colocated_case.case_colocated`).

Every ratio is taken per round between runs made back to back on the same processes, then its median
reported; times are in seconds, GB/s are 10^9 bytes of weights per second of sync.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.colocated_case import MODES, p95, speedup, way_seconds
from bench.report_stats import GB, MiB, label

CEILING_RATIO = 1.5
"""Target: a shared-memory sync's throughput at least this many times the raw gloo broadcast's (the ceiling)."""
SHARED_RATIO = 2.0
"""Target: the same where the trainer's tensors already live in shared memory (one copy in all)."""
VLLM_RATIO = 0.7
"""Target: a staged vLLM sync by shared memory, Prepare to applied, at most this times the same sync by broadcast."""

WAYS = (
    ("ceiling", "ceiling: raw gloo broadcast"),
    ("broadcast", "wsync, broadcast"),
    ("broadcast_digests", "wsync, broadcast, digests"),
    ("shm", "wsync, shared memory"),
    ("shm_digests", "wsync, shared memory, digests"),
    ("shm_shared", "wsync, shared memory, tensors in shared memory"),
    ("one_copy", "bound: one copy out of a shared mapping"),
)
"""The rows of a configuration, in the table's order, and their labels."""
BROADCAST_OF = {"shm": "broadcast", "shm_shared": "broadcast", "shm_digests": "broadcast_digests"}
"""Each shared-memory way and the broadcast it is compared with (digests alike)."""
VLLM_WAYS = (
    ("broadcast", "broadcast"),
    ("shm", "shared memory"),
    ("broadcast_nodigests", "broadcast, no digests"),
    ("shm_nodigests", "shared memory, no digests"),
)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _configs(c: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(model, mode, config)`` of every configuration, in the run's order."""
    return [(model, mode, cfg) for model, cfg in c["configs"].items() for mode in MODES if mode in cfg["rounds"]]


def _name(model: str, cfg: dict[str, Any], mode: str | None = None) -> str:
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(cfg["dtype"], cfg["dtype"])
    text = f"{label(model)} ({cfg['bytes'] / GB:.2f} GB {dtype})"
    return f"{text}, {mode}" if mode else text


def _ratio(cfg: dict[str, Any], mode: str, way: str) -> float:
    return _med(speedup(cfg["rounds"][mode], way))


def _zero_copy(c: dict[str, Any]) -> str:
    """How many of the ``shm_shared`` syncs' buckets the engine read from the trainer's storages (zero copy)."""
    read = total = 0
    for _, mode, cfg in _configs(c):
        for r in cfg["rounds"][mode]:
            total += int(r["shm_shared"].get("buckets", 0))
            read += int(r["shm_shared"].get("storage_buckets", 0))
    if not read:
        return "no bucket read zero-copy in this run"
    return f"zero copy: {read} of {total} buckets read from the trainer's storages"


def _worst(c: dict[str, Any], way: str) -> tuple[float, float, str]:
    """The smallest and largest median ratio to the ceiling of ``way`` over the configurations, and where the
    smallest is."""
    found = [(_ratio(cfg, mode, way), _name(model, cfg, mode)) for model, mode, cfg in _configs(c)]
    low = min(found)
    return low[0], max(found)[0], low[1]


def _vllm_ratio(v: dict[str, Any], way: str = "shm", over: str = "broadcast") -> float:
    """Median over the rounds of (``way``'s Prepare to applied / ``over``'s in the same round)."""
    return _med([r[way]["total"] / r[over]["total"] for r in v["rounds"]])


def _memory(c: dict[str, Any]) -> tuple[int, float, float, str]:
    """The engine's worst own peak extra memory in a streaming shared-memory sync (bytes), as a fraction of the
    ring's bytes, the worst with the ring's mapping counted, and where."""
    worst: tuple[float, int, float, str] = (-1.0, 0, 0.0, "")
    for model, cfg in c["configs"].items():
        runs = [("first sync", cfg["memory_first"])]
        runs += [("steady", r) for r in cfg["memory"]["streaming"]["shm"]]
        for kind, r in runs:
            own = int(r["sampled"]["RssAnon"])
            total = float(r["peak_extra"]) / cfg["ring_bytes"]
            x = own / cfg["ring_bytes"]
            if x > worst[0]:
                worst = (x, own, total, f"{label(model)}, {kind}")
    return worst[1], worst[0], worst[2], worst[3]


def checks(c: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(target, measured, passed)`` for the colocated targets."""
    out = []
    low, high, where = _worst(c, "shm")
    out.append(
        (
            f"colocated, shared memory: >= {CEILING_RATIO:g} x the gloo broadcast ceiling, every configuration",
            f"{low:.2f}-{high:.2f} x (least: {where})",
            low >= CEILING_RATIO,
        )
    )
    low, high, where = _worst(c, "shm_shared")
    out.append(
        (
            f"colocated, the trainer's tensors in shared memory: >= {SHARED_RATIO:g} x the ceiling",
            f"{low:.2f}-{high:.2f} x (least: {where}); {_zero_copy(c)}",
            low >= SHARED_RATIO,
        )
    )
    v = c.get("vllm")
    if v is not None:
        target = f"colocated vLLM, staged, Prepare to applied: shared memory <= {VLLM_RATIO:g} x broadcast"
        if v.get("rounds") and v["rounds"][0].get("shm"):
            ratio = _vllm_ratio(v)
            out.append((target, f"{ratio:.2f} x", ratio <= VLLM_RATIO))
        else:
            out.append((target, f"not measured: {(v.get('error') or 'no round')[:120]}", False))
    own, x, total, where = _memory(c)
    out.append(
        (
            "colocated, streaming: engine peak extra memory <= the ring's bytes",
            f"its own at most {own / MiB:,.0f} MiB = {x:.2f} x the ring ({where}); with the ring's pages mapped, "
            f"{total:.2f} x",
            x <= 1.0,
        )
    )
    out.append(("colocated syncs serve the trainer's bytes", *_verified(c)))
    return out


def _verified(c: dict[str, Any]) -> tuple[str, bool]:
    ok = all(cfg.get("verified") for cfg in c["configs"].values())
    return ("yes" if ok else "no"), ok


def _sec(x: float) -> str:
    return f"{x:.3f}"


def _throughput_rows(model: str, mode: str, cfg: dict[str, Any]) -> list[str]:
    rounds = cfg["rounds"][mode]
    nbytes = cfg["bytes"]
    rows = []
    for way, text in WAYS:
        secs = way_seconds(rounds, way)
        if way == "ceiling":
            first = cfg.get("first_ceiling")
        elif way == "one_copy":
            first = cfg.get("first_one_copy")
        else:
            first = cfg["first"][mode][way]["seconds"]
        cells = [
            f"{nbytes / _med(secs) / GB:.2f}",
            _sec(_med(secs)),
            _sec(p95(secs)),
            _sec(max(secs)),
            _sec(first) if first is not None else "",
            "1" if way == "ceiling" else f"{_ratio(cfg, mode, way):.2f}",
        ]
        if way in BROADCAST_OF:
            cells.append(f"{_med(speedup(rounds, way, BROADCAST_OF[way])):.2f}")
        else:
            cells.append("")
        if way in ("ceiling", "one_copy"):
            cells += ["", f"{_med([float(r['ceiling_cpu']) for r in rounds]):.2f}" if way == "ceiling" else ""]
        else:
            transfer = way_seconds(rounds, way, "broadcast")
            pack = way_seconds(rounds, way, "pack")
            cpu = way_seconds(rounds, way, "cpu")
            cells += [f"{nbytes / _med(transfer) / GB:.2f} ({_med(pack):.3f})", f"{_med(cpu):.2f}"]
        rows.append(f"| {_name(model, cfg, mode)} | {text} | " + " | ".join(cells) + " |")
    return rows


def _memory_rows(c: dict[str, Any]) -> list[str]:
    rows = []
    for model, cfg in c["configs"].items():
        ring = cfg["ring_bytes"]
        runs: list[tuple[str, list[dict[str, Any]]]] = [("first sync: streaming, shared memory", [cfg["memory_first"]])]
        for mode in MODES:
            if mode in cfg["memory"]:
                for key, text in (("shm", "shared memory"), ("broadcast", "broadcast")):
                    runs.append((f"steady: {mode}, {text}", cfg["memory"][mode][key]))
        for text, rs in runs:
            worst = max(rs, key=lambda r: r["peak_extra"])
            m = worst["sampled"]
            rows.append(
                f"| {_name(model, cfg)} | {text} | {worst['peak_extra'] / MiB:,.0f} | {m['RssAnon'] / MiB:,.0f} | "
                f"{m['RssShmem'] / MiB:,.0f} | {ring / MiB:,.0f} ({cfg['largest_bucket'] / MiB:,.0f} x 2) |"
            )
    return rows


def _vllm_rows(v: dict[str, Any]) -> list[str]:
    rows = []
    rounds = v["rounds"]
    for way, text in VLLM_WAYS:
        totals = [float(r[way]["total"]) for r in rounds]
        first = v.get("first", {}).get(way, {}).get("total")
        parts = [_med([float(r[way][k]) for r in rounds]) for k in ("prepare", "broadcast", "complete", "verify")]
        apply = _med([float(r[way]["apply"]) for r in rounds])
        over = "broadcast" if way in ("broadcast", "shm") else "broadcast_nodigests"
        ratio = "1" if way == over else f"{_vllm_ratio(v, way, over):.2f}"
        rows.append(
            f"| {text} | {_sec(_med(totals))} | {_sec(p95(totals))} | {_sec(max(totals))} | "
            f"{_sec(first) if first is not None else ''} | " + " | ".join(_sec(x) for x in parts) + f" | {_sec(apply)}"
            f" | {ratio} |"
        )
    return rows


def _trainer_profile(c: dict[str, Any]) -> str:
    """Where the trainer's time goes in a shared-memory sync, from the syncs' own phases."""
    parts = []
    for model, mode, cfg in _configs(c):
        rounds = cfg["rounds"][mode]
        transfer = _med(way_seconds(rounds, "shm", "broadcast"))
        pack = _med(way_seconds(rounds, "shm", "pack"))
        hashed = _med(way_seconds(rounds, "shm_digests", "broadcast")) - transfer
        parts.append(
            f"{_name(model, cfg, mode)}: packing {pack:.3f} s of a {transfer:.3f} s transfer "
            f"({pack / transfer:.0%}, {cfg['bytes'] / pack / GB:.1f} GB/s), digests +{hashed:.3f} s"
        )
    return "; ".join(parts)


def section(c: dict[str, Any]) -> str:
    """The markdown section: what ran, the throughput table, memory, vLLM, where the trainer's time goes."""
    reps = c["reps"]
    lines = [
        "## Colocated: shared memory against the broadcast on one host",
        "",
        "One engine process per configuration (the tensor engine of `wsync serve --synthetic`, plus the raw "
        "broadcast's routes: `bench/engine.py`) and the trainer (the bench process) on this host. After a warm-up "
        f"(every way twice), each of {reps} rounds runs back to back on the same processes: the ceiling (one raw "
        "gloo broadcast of the model's bytes over loopback into a touched buffer), then, in an order rotated "
        'each round, `sync` by broadcast and by `transport="shared_memory"` (digests off, as the other cases; '
        "and again with digests, the client's default on CPU), and by shared memory once more from a copy "
        "of the trainer's tensors moved to shared memory (`share_memory_()`, what `Module.share_memory()` "
        "does: the transport's zero-copy path, the engine reading every bucket from the trainer's storages with "
        "`pread`, nothing packed); last, not a sync, the model's bytes copied once out of a memfd mapped "
        "read-only into touched memory (the bound of one copy through a mapping, which the zero-copy path does "
        "not use: a storage its owner shrinks would crash the engine). Each way's measured sync comes right after "
        "an unmeasured one of its own: a trainer syncs one way every step, and the engine's receive buffers are "
        "then what that way leaves (ways differ in them: a staged sync through shared memory copies each tensor "
        "into a buffer of its own that the engine then serves, a broadcast receives whole buckets), which a sync "
        "right after another way's would pay to reshape. GB/s: the payload over the sync's wall "
        "time (`transfer`: over the trainer's send phase, "
        "`SyncResult.broadcast_seconds`, with its packing seconds in brackets); x ceiling and x broadcast: "
        "per round, then the median; p95 over the rounds (interpolated); first: the way's first sync in "
        "that apply mode on the engine (the warm-up's first); CPU: trainer and engine, every thread"
        + (f"; measured {c['date']} (`--cases colocated`)" if c.get("date") else "")
        + ".",
        "",
        "| configuration | way | GB/s | s median | s p95 | s max | s first | x ceiling | x broadcast "
        "| transfer GB/s (pack s) | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, mode, cfg in _configs(c):
        lines += _throughput_rows(model, mode, cfg)
    low, high, where = _worst(c, "shm")
    one_low, one_high, _ = _worst(c, "one_copy")
    sh_low, sh_high, _ = _worst(c, "shm_shared")
    lines += [
        "",
        f"Shared memory reaches {low:.2f}-{high:.2f} x the ceiling (least: {where}). Where the trainer's time goes "
        f"(medians, digests off): {_trainer_profile(c)}. The trainer packs every bucket into a slot with one "
        "single-threaded `memmove` per tensor (`pack_bucket`), hashes the slot when digests are on, and the "
        "engine copies each tensor out of the slot into a buffer it then serves (staged: Complete swaps it in, "
        "copying nothing) or straight into the served tensor (streaming without digests; with them, into a "
        "buffer first and loaded once checked: a third pass), all on this host's cores. "
        f"With the trainer's tensors already in shared memory the sync reaches {sh_low:.2f}-{sh_high:.2f} x the "
        f"ceiling ({_zero_copy(c)}): nothing is packed, and each engine worker reads the storages with `pread` "
        "on two threads, a kernel copy (never a mapping: the storages are not sealed); one copy out of a shared "
        f"mapping takes {one_low:.1f}-{one_high:.1f} x less time than the ceiling, but a trainer shrinking its "
        "storage would crash an engine reading that way.",
        "",
        "Engine memory during a sync: the engine process's peak resident memory above its level before the "
        "sync (`VmHWM`, reset through `/proc/PID/clear_refs`), split by a sampler reading `/proc/PID/status` "
        "every 2 ms into its own (`RssAnon`) and the ring's pages mapped (`RssShmem`: the trainer's memfd, "
        "counted in both processes' resident memory but present once); MiB, the worst of the syncs:",
        "",
        "| model | sync | peak extra | its own | the ring mapped | the ring's bytes (slot x slots) |",
        "|---|---|---|---|---|---|",
        *_memory_rows(c),
    ]
    v = c.get("vllm")
    if v is not None:
        lines += ["", *_vllm_section(v)]
    return "\n".join(lines)


def _vllm_section(v: dict[str, Any]) -> list[str]:
    head = (
        f"vLLM (`wsync serve --engine vllm`, {v['model']}, {v['bytes'] / GB:.2f} GB in float32, started in "
        f"{v.get('start_seconds', 0):.0f} s): staged syncs by broadcast and by shared memory, with the client's "
        f"digests and without, rotated in each of {len(v.get('rounds', []))} rounds after a warm-up round "
        "(first); Prepare to applied (`SyncResult.total_seconds`) and its phases, medians, seconds:"
    )
    if not v.get("rounds") or not v["rounds"][0].get("shm"):
        return [head, "", f"Not measured: {v.get('error') or 'no round ran'}."]
    ratio = _vllm_ratio(v)
    verify = _med([float(r["shm"]["verify"]) for r in v["rounds"]])
    total = _med([float(r["shm"]["total"]) for r in v["rounds"]])
    return [
        head,
        "",
        "| way | median | p95 | max | first | Prepare | transfer | Complete | of which verifying | apply "
        "| x broadcast |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *_vllm_rows(v),
        "",
        f"By shared memory a staged vLLM sync takes {ratio:.2f} x the broadcast's time. Complete's verifying "
        f"phase (the worker preparing the staged weights beside the live model: each bucket loaded into its "
        f"shadow layers through vLLM's weight processing, finished after the last one) takes {verify:.3f} s of "
        f"its {total:.3f} s whatever the transport; the transport can shorten only the rest.",
    ]


def missed(c: dict[str, Any], failed: list[str]) -> str:
    """Section 8's paragraph for the colocated targets missed: by how much, why, what would close them."""
    out = []
    low, _, where = _worst(c, "shm")
    if low < CEILING_RATIO:
        _, mode, cfg = min(_configs(c), key=lambda t: _ratio(t[2], t[1], "shm"))
        r = cfg["rounds"][mode]
        transfer = _med(way_seconds(r, "shm", "broadcast"))
        pack = _med(way_seconds(r, "shm", "pack"))
        ceiling = _med(way_seconds(r, "ceiling"))
        cores = _med([x["shm"]["cpu"] / x["shm"]["seconds"] for x in r])
        out.append(
            f"Shared memory reaches {low:.2f} x the ceiling at least ({where}; target {CEILING_RATIO:g} x). Its "
            f"transfer phase alone runs at {ceiling / transfer:.2f} x the ceiling's rate, but the sync adds what a "
            f"raw broadcast does not do: Prepare with the segment's handover "
            f"({_med(way_seconds(r, 'shm', 'prepare')):.3f} s) and Complete with the apply "
            f"({_med(way_seconds(r, 'shm', 'complete')):.3f} s); and within the transfer the trainer packs every "
            f"byte into the ring on one thread ({pack:.3f} s, {pack / transfer:.0%} of it) while the engine copies "
            f"them out: two passes over the bytes, three when streaming, on this host's two cores (the sync kept "
            f"{cores:.1f} cores busy). What would close it: fewer passes (the zero-copy path below, for tensors "
            "already in shared memory) and packing on several threads where cores are free."
        )
    low, _, where = _worst(c, "shm_shared")
    if low < SHARED_RATIO:
        one, _, _ = _worst(c, "one_copy")
        _, mode, cfg = min(_configs(c), key=lambda t: _ratio(t[2], t[1], "shm_shared"))
        r = cfg["rounds"][mode]
        transfer = _med(way_seconds(r, "shm_shared", "broadcast"))
        ceiling = _med(way_seconds(r, "ceiling"))
        out.append(
            f"With the trainer's tensors in shared memory the sync reaches {low:.2f} x the ceiling at least "
            f"({where}; target {SHARED_RATIO:g} x; {_zero_copy(c)}). Nothing is packed: its transfer phase runs "
            f"at {ceiling / transfer:.2f} x the ceiling's rate, the engine reading each storage with `pread` on two "
            "threads (a kernel copy, about 3.5 GB/s a thread here, where a copy out of a mapping runs at "
            f"{one:.1f} x the ceiling; the storages are not sealed, so a mapping could crash the engine). The sync "
            f"adds Prepare ({_med(way_seconds(r, 'shm_shared', 'prepare')):.3f} s) and Complete "
            f"({_med(way_seconds(r, 'shm_shared', 'complete')):.3f} s; a staged apply swaps in the buffers read "
            "into, copying nothing) and the round trips between them, a fixed cost that weighs most on the "
            "smaller model."
        )
    v = c.get("vllm")
    if v is not None and any("vLLM" in f for f in failed):
        if v.get("rounds") and v["rounds"][0].get("shm"):
            verify = _med([float(r["shm"]["verify"]) for r in v["rounds"]])
            out.append(
                f"vLLM by shared memory takes {_vllm_ratio(v):.2f} x the broadcast's time (target "
                f"{VLLM_RATIO:g} x): {verify:.3f} s of it is Complete's verifying phase (the worker preparing the "
                "staged weights beside the live model), the same for both transports; shared memory shortens only "
                "the transport's part."
            )
        else:
            out.append(f"vLLM by shared memory did not run: {v.get('error')}.")
    return "**Colocated.** " + " ".join(out) if out else ""


def plot(plt: Any, c: dict[str, Any], path: Path) -> None:
    """GB/s of each way per configuration (median, min-max bars), with the targets' multiples of the ceiling."""
    configs = _configs(c)
    shown = [w for w in WAYS if w[0] not in ("broadcast_digests", "shm_digests")]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(shown)
    top = 0.0
    for j, (way, text) in enumerate(shown):
        meds, below, above = [], [], []
        for _, mode, cfg in configs:
            gbps = [cfg["bytes"] / s / GB for s in way_seconds(cfg["rounds"][mode], way)]
            m = _med(gbps)
            meds.append(m)
            below.append(m - min(gbps))
            above.append(max(gbps) - m)
            top = max(top, max(gbps))
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(configs))]
        ax.bar(xs, meds, width, yerr=[below, above], capsize=2, label=text, color=f"C{j}")
    for i, (_, mode, cfg) in enumerate(configs):
        ceiling = _med([cfg["bytes"] / s / GB for s in way_seconds(cfg["rounds"][mode], "ceiling")])
        for k, style in ((CEILING_RATIO, "--"), (SHARED_RATIO, ":")):
            ax.hlines(k * ceiling, i - 0.45, i + 0.45, colors="k", linestyles=style, lw=1)
    ax.plot([], [], "k--", lw=1, label=f"target: {CEILING_RATIO:g} x ceiling")
    ax.plot([], [], "k:", lw=1, label=f"target, tensors in shared memory: {SHARED_RATIO:g} x ceiling")
    ax.set_xticks(range(len(configs)), [_name(m, cfg, mode).replace(" (", "\n(", 1) for m, mode, cfg in configs])
    ax.set_ylim(0, 1.45 * top)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("GB/s (bytes of weights / sync seconds)")
    ax.set_title("Colocated trainer and engine, one host: median of paired rounds, bars min-max", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
