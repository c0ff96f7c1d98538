"""The standalone weight-sync process group (join, broadcast, bounded waits, leave)."""
