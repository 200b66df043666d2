"""The fleet's view of tier 3, outside any one server: which nodes can serve how long a prefix
(fleet_view.py), the shared pool as one KV-event stream (pool_stream.py, `radixtier pool-events`)
and its HTTP view (pool_http.py)."""
