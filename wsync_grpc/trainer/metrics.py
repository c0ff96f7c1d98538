"""The trainer client's Prometheus metrics, in a registry the caller serves (``TrainerClient.metrics_registry``).

Serve it with ``prometheus_client.start_http_server(port, registry=client.metrics_registry)``, or
add it to a training job's own registry. The per-phase histogram matches the engines'
``wsync_update_phase_duration_seconds`` (see :mod:`wsync_grpc.service.metrics`):

- ``wsync_trainer_sync_phase_duration_seconds{phase}``: ``plan``, ``init``, ``prepare`` (the Prepare
  round trip), ``pack`` (packing, overlapped with the wire), ``broadcast`` (first broadcast posted to the
  last one finished), ``verify`` (every engine's verifying Complete), ``apply`` (the applying Complete
  round trip) and ``total`` (first Prepare to the last Complete reply) of every successful sync;
- ``wsync_trainer_syncs_total{outcome, stage}``: syncs by outcome (``applied``, ``failed``) and the stage a
  failure happened at;
- ``wsync_trainer_sent_bytes_total``: bytes broadcast by successful syncs;
- ``wsync_trainer_engines_excluded_total{target}``: times the ``exclude`` fleet policy left an engine out
  (:mod:`wsync_grpc.trainer.roster`); one series per member, so bounded by the fleet;
- ``wsync_trainer_members{state}``: the client's members by state (``in_sync``, ``behind``, ``excluded``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from wsync_grpc.trainer.results import SyncResult

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram buckets, in seconds (the engines' own)."""


class TrainerMetrics:
    """The client's metrics.

    Args:
        registry: where to register them; ``None`` = a fresh ``CollectorRegistry``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.phase = Histogram(
            "wsync_trainer_sync_phase_duration_seconds",
            "Duration of each phase of a successful sync, in seconds",
            ["phase"],
            registry=self.registry,
            buckets=DURATION_BUCKETS,
        )
        self.syncs = Counter(
            "wsync_trainer_syncs", "Syncs by outcome and the stage a failure happened at", ["outcome", "stage"],
            registry=self.registry,
        )  # fmt: skip
        self.sent = Counter("wsync_trainer_sent_bytes", "Bytes broadcast by successful syncs", registry=self.registry)
        self.excluded = Counter(
            "wsync_trainer_engines_excluded", "Times the fleet policy left an engine out of an update", ["target"],
            registry=self.registry,
        )  # fmt: skip
        self.members = Gauge(
            "wsync_trainer_members", "The client's engines by state (in_sync, behind, excluded)", ["state"],
            registry=self.registry,
        )  # fmt: skip

    def sync_applied(self, r: SyncResult) -> None:
        """Record a successful sync's phases (see :attr:`SyncResult.phases`) and bytes."""
        for name, seconds in {"plan": r.plan_seconds, "init": r.init_seconds, "pack": r.pack_seconds}.items():
            self.phase.labels(phase=name).observe(seconds)
        for name, seconds in r.phases.items():
            self.phase.labels(phase=name).observe(seconds)
        self.phase.labels(phase="total").observe(r.total_seconds)
        self.syncs.labels(outcome="applied", stage="").inc()
        self.sent.inc(r.wire_bytes)

    def sync_failed(self, stage: str) -> None:
        """Record a failed sync and the stage it failed at."""
        self.syncs.labels(outcome="failed", stage=stage).inc()
