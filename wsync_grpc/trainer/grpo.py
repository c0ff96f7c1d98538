"""TRL's ``GRPOTrainer`` syncing its policy into wsync engines (the ``trl`` extra; TRL pinned at :data:`TRL_VERSION`).

TRL's ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="server"`` generates
its rollouts through a vLLM server's OpenAI API (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``), which
``wsync serve --engine vllm`` serves, and pushes its weights with TRL's
``VLLMClient`` (``trl.generation.vllm_client``): ``init_communicator`` (a
raw NCCL group, CUDA only), ``update_named_params`` (a raw broadcast after
vLLM's ``/update_weights``) and ``reset_prefix_cache``. Every training
process iterates the parameters when TRL syncs (FSDP and ZeRO-3 gathers are
collectives); the main process pushes.

:class:`WsyncVLLMClient` is that client with those three calls going through
a :class:`~wsync_grpc.trainer.client.TrainerClient`: any device (gloo on
CPU), staged apply by default (rollouts keep flowing while the bytes
arrive), the cache flushed by the update itself, the fleet committed all or
nothing, and a failed sync raised as :class:`~wsync_grpc.trainer.results.SyncError`
out of ``trainer.train()``. Generation is TRL's, untouched.

:class:`WsyncGRPOTrainer` is ``GRPOTrainer`` with that client, its weight
version naming the global step (``step-N``: the weights after N optimizer
steps). TRL builds its client inside ``VLLMGeneration._init_vllm`` by the
name ``VLLMClient`` of ``trl.generation.vllm_generation`` and offers no
hook, so the trainer points that one name at :class:`WsyncVLLMClient` for
the duration of its own construction (and nothing else of TRL).

Every sync is logged through TRL's own logging: an entry of
``trainer.state.log_history`` (:func:`sync_log_entry`'s ``wsync/...`` numbers)
that reaches every logger of ``report_to``; ``trainer.last_sync``,
``trainer.trainer_client`` and the return of ``trainer.sync_weights()`` give
the :class:`~wsync_grpc.trainer.results.SyncResult` and the client themselves.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import trl
import trl.generation.vllm_generation as vllm_generation
from trl import GRPOTrainer
from trl.generation.vllm_client import VLLMClient

from wsync_grpc.trainer.client import TrainerClient
from wsync_grpc.trainer.options import ApplyMode
from wsync_grpc.trainer.results import SyncResult

TRL_VERSION = "1.16.0"
"""The TRL release this integration is tested with (``wsync-grpc[trl]`` pins it)."""

_construction = threading.Lock()


def step_version(step: int) -> str:
    """The weight version of the policy after ``step`` optimizer steps: ``"step-<step>"``."""
    return f"step-{step}"


def version_step(version: str) -> int | None:
    """The step ``N`` of a ``"step-N"`` weight version (the inverse of :func:`step_version`); ``None`` for another."""
    head, _, n = version.partition("-")
    return int(n) if head == "step" and n.isdigit() else None


def sync_log_entry(result: SyncResult) -> dict[str, float]:
    """What TRL's log records of one sync: numbers only, under ``wsync/`` keys.

    Numbers only because transformers' ``Trainer.log`` hands its dict unchanged to
    every callback's ``on_log`` and the loggers take scalars (TensorBoard's drops any
    other value with a warning); so the version is its step and the engines are counts.

    Keys:
        ``wsync/weight_version_step``: ``N`` of the version ``step-N`` (left out for a version
        not so named: :func:`version_step`).
        ``wsync/payload_bytes``, ``wsync/wire_bytes``: :attr:`SyncResult.payload_bytes` and
        :attr:`SyncResult.wire_bytes`, in bytes.
        ``wsync/total_seconds``: :attr:`SyncResult.total_seconds` (first Prepare to the last
        Complete reply), in seconds.
        ``wsync/gb_per_s``: :attr:`SyncResult.gb_per_s`, in GB/s (10^9 bytes per second).
        ``wsync/engines``: how many engines serve the version now (:attr:`SyncResult.engines`).
        ``wsync/excluded``: how many engines the fleet policy left out (:attr:`SyncResult.excluded`).
    """
    entry: dict[str, float] = {}
    step = version_step(result.weight_version)
    if step is not None:
        entry["wsync/weight_version_step"] = step
    entry.update(
        {
            "wsync/payload_bytes": result.payload_bytes,
            "wsync/wire_bytes": result.wire_bytes,
            "wsync/total_seconds": result.total_seconds,
            "wsync/gb_per_s": result.gb_per_s,
            "wsync/engines": len(result.engines),
            "wsync/excluded": len(result.excluded),
        }
    )
    return entry


class WsyncVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` whose weight sync goes through wsync (generation unchanged).

    Args:
        base_url, host, server_port, group_port, connection_timeout: TRL's (``group_port``, from
            ``GRPOConfig.vllm_group_port``, is the port of the group's rendezvous store on the trainer).
        targets: the engines' ``wsync.v1`` gRPC targets (``host:port``); the first serves TRL's generation
            at ``base_url``, the others are synced with it (one committed update).
        client_options: further :class:`~wsync_grpc.trainer.client.TrainerClient` keyword arguments
            (``master_address`` for engines on other hosts, ``token``, ``credentials``, timeouts...).
        apply_mode: ``"staged"`` (default: generation keeps running during the transfer) or ``"streaming"``.
        on_sync: called after every successful sync with its result (e.g. to log or verify).

    Attributes:
        version_of: returns the weight version of the next sync (:class:`WsyncGRPOTrainer`
            sets it to name the global step; by default ``sync-<count>``).
        trainer_client: the :class:`~wsync_grpc.trainer.client.TrainerClient`, once
            :meth:`init_communicator` ran.
        last_result: the last sync's result.
        last_sent: while ``on_sync`` runs, the ``(name, tensor)`` pairs that sync sent (whole
            tensors, as TRL gathered them); empty otherwise.

    Raises:
        ConnectionError: TRL's: the HTTP server did not answer within ``connection_timeout`` seconds.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        targets: Sequence[str],
        client_options: Mapping[str, Any] | None = None,
        apply_mode: ApplyMode = "staged",
        on_sync: Callable[[SyncResult], None] | None = None,
    ) -> None:
        if not targets:
            raise ValueError("WsyncVLLMClient needs at least one wsync.v1 target")
        super().__init__(base_url, host, server_port, group_port, connection_timeout)
        self.targets = list(targets)
        self.client_options = dict(client_options or {})
        self.apply_mode: ApplyMode = apply_mode
        self.on_sync = on_sync
        self.syncs = 0
        self.version_of: Callable[[], str] = lambda: f"sync-{self.syncs}"
        self.trainer_client: TrainerClient | None = None
        self.last_result: SyncResult | None = None
        self.last_sent: list[tuple[str, torch.Tensor]] = []

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Form the weight-sync group with every engine (``Init``), on ``device``'s backend (gloo on CPU).

        ``device`` is TRL's ``accelerator.device`` (an ``int`` is a CUDA index).

        Raises:
            SyncError: an engine refused or could not join.
        """
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        options: dict[str, Any] = {"master_port": self.group_port, "device": dev, **self.client_options}
        self.trainer_client = TrainerClient(self.targets, **options)
        self.trainer_client.init()
        atexit.register(self.close_communicator)

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """TRL's grouping of several updates: each wsync sync is already one committed update."""
        yield

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """Sync ``named_params`` to every engine as :attr:`version_of`'s version, the cache flushed.

        The pairs are read to their end first, whatever happens next: reading
        them is where the other training processes' gathers complete.
        ``metadata`` (TRL's announcement of the pairs) is checked against them.

        Raises:
            ValueError: the pairs are not the tensors ``metadata`` announced.
            SyncError: the sync failed on some engine; none of them published it.
        """
        pairs = list(named_params)
        if [name for name, _ in pairs] != [name for name, _, _ in metadata]:
            raise ValueError("the parameters streamed are not the ones announced")
        if self.trainer_client is None:
            self.init_communicator("cpu" if not pairs else pairs[0][1].device)
        assert self.trainer_client is not None
        result = self.trainer_client.sync(pairs, self.version_of(), apply_mode=self.apply_mode, flush_cache=True)
        self.syncs += 1
        self.last_result = result
        if self.on_sync is not None:
            self.last_sent = pairs
            try:
                self.on_sync(result)
            finally:
                self.last_sent = []

    def reset_prefix_cache(self) -> None:
        """Nothing to do: every sync flushed the engines' caches as part of the update (``flush_cache``)."""

    def close_communicator(self) -> None:
        """Leave the group and close the engines' channels. Idempotent."""
        client, self.trainer_client = self.trainer_client, None
        if client is not None:
            client.close()


class WsyncGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` in server mode whose weight syncs go through wsync (:class:`WsyncVLLMClient`).

    Takes ``GRPOTrainer``'s arguments, ``args`` a ``GRPOConfig`` with
    ``use_vllm=True, vllm_mode="server"`` and ``vllm_server_base_url`` (or
    host and port) naming the HTTP API of the engine at ``wsync_targets[0]``.
    Every process constructs and trains it as usual (``accelerate launch``);
    the main process holds the client.

    Every sync is logged (:meth:`log_sync`): one entry of ``state.log_history``
    per sync, on the main process, which every logger of ``report_to`` receives.
    :attr:`last_sync`, :attr:`trainer_client` and the return of
    :meth:`sync_weights` give the result and the client themselves.

    Args:
        wsync_targets: the engines' ``wsync.v1`` gRPC targets.
        wsync_options: further ``TrainerClient`` keyword arguments (see :class:`WsyncVLLMClient`).
        wsync_apply_mode: ``"staged"`` (default) or ``"streaming"``.
        wsync_on_sync: called on the main process after every successful sync, once it is logged
            (the client's ``on_sync`` is the trainer's: it logs, then calls this).

    Raises:
        ValueError: ``args`` is not server mode with vLLM, or no target.
        RuntimeError: the installed TRL is not :data:`TRL_VERSION`.
    """

    def __init__(
        self,
        *args: Any,
        wsync_targets: Sequence[str],
        wsync_options: Mapping[str, Any] | None = None,
        wsync_apply_mode: ApplyMode = "staged",
        wsync_on_sync: Callable[[SyncResult], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if trl.__version__ != TRL_VERSION:
            raise RuntimeError(f"wsync's GRPO integration is tested with TRL {TRL_VERSION}, not {trl.__version__}")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is None or not getattr(config, "use_vllm", False) or getattr(config, "vllm_mode", "") != "server":
            raise ValueError('WsyncGRPOTrainer needs a GRPOConfig with use_vllm=True and vllm_mode="server"')
        if not wsync_targets:
            raise ValueError("WsyncGRPOTrainer needs at least one wsync.v1 target")
        made: list[WsyncVLLMClient] = []
        self.wsync_on_sync = wsync_on_sync

        def client(*a: Any, **k: Any) -> WsyncVLLMClient:
            c = WsyncVLLMClient(
                *a,
                targets=wsync_targets,
                client_options=wsync_options,
                apply_mode=wsync_apply_mode,
                on_sync=self._synced,
                **k,
            )
            made.append(c)
            return c

        with _construction:
            original = vllm_generation.VLLMClient
            vllm_generation.VLLMClient = client
            try:
                super().__init__(*args, **kwargs)
            finally:
                vllm_generation.VLLMClient = original
        for c in made:
            c.version_of = lambda: step_version(int(self.state.global_step))

    def _synced(self, result: SyncResult) -> None:
        """The client's ``on_sync``: log the sync, then call ``wsync_on_sync``."""
        self.log_sync(result)
        if self.wsync_on_sync is not None:
            self.wsync_on_sync(result)

    def log_sync(self, result: SyncResult) -> None:
        """Log one sync's :func:`sync_log_entry` as its own entry of TRL's log (called after every sync).

        Through transformers' ``Trainer.log`` (``super(GRPOTrainer, self).log``): it appends the
        entry to ``state.log_history`` with ``"step"`` (the global step) and ``"epoch"``, and calls
        every callback's ``on_log``, so the numbers reach whatever logger ``report_to`` configured.

        Not through ``GRPOTrainer.log``, nor into TRL's ``_metrics`` (TRL 1.16.0): TRL syncs inside
        ``_generate``, before a step's rollouts, while it collects the logging window's metrics in
        ``_metrics``; its ``log`` averages every ``_metrics`` list into the entry it is given, clears
        them, and (``log_completions``) prints and writes the completions table. Calling
        ``GRPOTrainer.log`` at a sync would put the window's metrics so far (with ``logging_steps > 1``,
        earlier steps') into the sync's entry instead of the step's, and write a completions table per
        sync. Appending to ``_metrics`` would average the syncs of a window together (their versions
        too) into the step's entry, and never log a sync made after the last step
        (``sync_weights()`` after ``train()``). Its own entry leaves TRL's per-step entries as they
        are and records every sync once, at the global step it was made.

        Raises:
            Whatever a callback's ``on_log`` raises (the sync itself succeeded: :attr:`last_sync`).
        """
        super(GRPOTrainer, self).log(sync_log_entry(result))

    def sync_weights(self) -> SyncResult | None:
        """Push the current policy now, as ``step-<global_step>`` (e.g. once more after ``train()``).

        Every process calls it, as TRL's own sync (its gathers are collectives). The sync is logged
        as TRL's are (:meth:`log_sync`).

        Returns:
            On the main process, the sync's :class:`~wsync_grpc.trainer.results.SyncResult` (also
            :attr:`last_sync`); ``None`` on the other processes.

        Raises:
            SyncError: on the main process, the sync failed; no engine published it.
        """
        self.vllm_generation.sync_weights()
        self._last_loaded_step = self.state.global_step
        return self.last_sync

    @property
    def wsync_client(self) -> WsyncVLLMClient | None:
        """The main process's :class:`WsyncVLLMClient` (``None`` on the other processes)."""
        c = getattr(self.vllm_generation, "vllm_client", None)
        return c if isinstance(c, WsyncVLLMClient) else None

    @property
    def last_sync(self) -> SyncResult | None:
        """The last successful sync's :class:`~wsync_grpc.trainer.results.SyncResult` (TRL's or
        :meth:`sync_weights`'); ``None`` before the first one and on the processes other than the main one."""
        c = self.wsync_client
        return c.last_result if c is not None else None

    @property
    def trainer_client(self) -> TrainerClient | None:
        """The main process's :class:`~wsync_grpc.trainer.client.TrainerClient` (``status()``,
        ``checksums()``...), once TRL formed the group (``init_communicator``, at construction);
        ``None`` on the other processes and once :meth:`WsyncVLLMClient.close_communicator` ran."""
        c = self.wsync_client
        return c.trainer_client if c is not None else None
