"""ckptflow: scheduled checkpoint policies for GPU inference workers.

The package is layered (see docs/design/layers.md): ``policies``, ``runners`` and
``store`` never import Prefect; only ``tasks`` and ``flows`` do.
"""

__version__ = "0.1.0"
