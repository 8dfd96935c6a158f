"""Node-level mechanisms: CRIU, the CUDA driver checkpoint API, the worker's HTTP side, and the
runners that tie them to the store (node.py: whole process; twotier.py: template + sessions).
No Prefect here."""
