"""Real serving engines: each module holds one engine's own HTTP (health, slots, sessions),
its launch command and what the fleet file needs to declare it. Node-level like runners/:
no Prefect here.

- ``llamacpp``: llama.cpp's ``llama-server`` (built by scripts/install-llamacpp.sh).
- ``llamacpp_model``: the deterministic random-weight GGUF the tests and benches serve.
"""
