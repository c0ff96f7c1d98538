"""The engines ``wsync serve --engine NAME`` serves, as registered plug-ins.

:mod:`~wsync_grpc.tools.engines.registry` holds the registry and what a plug-in
implements; one module per built-in engine holds its plug-in
(:mod:`~wsync_grpc.tools.engines.reference`, :mod:`~wsync_grpc.tools.engines.synthetic`,
:mod:`~wsync_grpc.tools.engines.vllm`, whose server is
:mod:`~wsync_grpc.tools.engines.vllm_server`).

Adding an engine: write its :class:`~wsync_grpc.core.engine.Engine` under
``wsync_grpc/engines/`` (or in its own package), then a plug-in, an
:class:`EngineFactory` (``wsync serve`` serves the engine it builds) or an
:class:`EngineServer` (it runs its own server and the weight-sync one beside it),
with a ``name``, a one-line ``help``, its options (:meth:`EnginePlugin.add_options`)
and their check (:meth:`EnginePlugin.check`, raising :class:`UsageError`). Register
it in :data:`~wsync_grpc.tools.engines.registry.BUILTIN` (shipped with wsync), in
the ``wsync.engines`` entry-point group of its package (third party), or with
:func:`register_engine` at run time.
"""

from wsync_grpc.tools.common import UsageError
from wsync_grpc.tools.engines.registry import (
    DEFAULT_ENGINE,
    ENTRY_POINT_GROUP,
    BuiltEngine,
    EngineFactory,
    EngineOptions,
    EnginePlugin,
    EngineServer,
    ServerOptions,
    engine_plugin,
    load_entry_points,
    register_engine,
    registered_engines,
    unregister_engine,
)
from wsync_grpc.tools.orphans import end_with_parent_if_spawned

__all__ = [
    "DEFAULT_ENGINE",
    "ENTRY_POINT_GROUP",
    "BuiltEngine",
    "EngineFactory",
    "EngineOptions",
    "EnginePlugin",
    "EngineServer",
    "ServerOptions",
    "UsageError",
    "engine_plugin",
    "load_entry_points",
    "register_engine",
    "registered_engines",
    "unregister_engine",
]

# vLLM's engine core and workers, spawned by ``wsync serve --engine vllm``, import this package first (as their
# parent's main module, ``wsync_grpc.tools.cli``, does): from here on they end with their parent, even when it
# is SIGKILLed (a no-op in any other process; see wsync_grpc.tools.orphans).
end_with_parent_if_spawned()
