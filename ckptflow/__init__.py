"""ckptflow: scheduled checkpoint policies for GPU inference workers.

The package is layered, imports pointing only down (README.md, "What is where"):
``cli``/``demo`` → ``flows`` → ``tasks`` → ``runners``, ``store``, ``fleet`` → ``policies`` →
``models``, ``errors`` and ``settings``. ``policies``, ``runners``, ``store`` and ``engines``
never import Prefect; only ``tasks`` and ``flows`` do (tests/test_layering.py checks it). The
layer table is docs/ARCHITECTURE.md; tests/test_layers.py fails on a cycle or an upward import.
"""

__version__ = "0.1.0"
