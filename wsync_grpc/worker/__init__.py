"""The worker side: what runs where the weights live (the receiver, its bucket feed and buffer pool).

It depends on the core and the process group only, never on the servicer, so it can run inside
another process (an engine's worker).
"""
