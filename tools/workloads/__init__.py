"""Synthetic request traces in the conversation trace's format, by workload shape.

``python -m tools.workloads SHAPE --requests N --seed S --out PATH`` writes one (``--help``);
``generate(shape, requests, seed, **params)`` returns its records in-process. Shapes: ``chat``,
``docqa``, ``agent``, ``fewshot``, ``scan`` (``shapes.py``, each with its parameters) and ``mix``
(``generate.py``).
"""

from tools.workloads.generate import SHAPES, generate, make_shape
from tools.workloads.summary import Summary, summarize

__all__ = ["SHAPES", "Summary", "generate", "make_shape", "summarize"]
