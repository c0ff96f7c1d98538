"""The engine side: the update session, the thin ``wsync.v1.WeightSyncService`` servicer over it, the server."""
