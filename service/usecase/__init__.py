"""Use cases: what the routers and the sweeper ask of the service."""
