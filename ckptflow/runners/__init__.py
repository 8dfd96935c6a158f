"""Node-level mechanisms: CRIU and the CUDA driver checkpoint API. No Prefect here."""
