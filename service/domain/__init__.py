"""The service's pure core: runs, prepared batches, step progress and finalisation.

Nothing here knows of HTTP, SQL or Redis; the stores and the use cases share it.
"""
