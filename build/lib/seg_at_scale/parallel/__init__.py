"""Parallel training: sample parallelism over ranks, Pipe pipelines, both together.

fairscale is imported only by :mod:`seg_at_scale.parallel.pipe`.
"""
