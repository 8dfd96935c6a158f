"""Node-level mechanisms: CRIU, the GPU backends (gpu/: the CUDA driver checkpoint API), the worker's
HTTP side, and the runners that tie them to the store (node.py: whole process; template_sessions.py: template +
sessions; modes.py: the checkpoint mode a workload names). No Prefect here."""
