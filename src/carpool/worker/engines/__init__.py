"""Engines behind one small interface (:class:`carpool.worker.engines.base.Engine`)."""
