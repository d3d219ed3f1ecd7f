"""The membership store's implementations: the TCP store server (server.py, `python -m engine.store`), the etcd
client (etcd.py) over its HTTP gateway (etcd_gateway.py), an in-memory store for tests (memory.py), and the probe
the console starts beside the store (probe.py). How a node connects to one is the mesh's business
(engine/mesh/connect.py)."""
