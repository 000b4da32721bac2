"""carpool: a ZeroMQ inference fleet with deadline-aware dynamic batching.

Importing this package loads nothing heavy; the SDK lives in :mod:`carpool.client`.
"""

__version__ = "0.1.0"
