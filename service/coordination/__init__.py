"""Coordination of replicas through Redis (only when ``STEPTALLY_REDIS_URL`` is set)."""
