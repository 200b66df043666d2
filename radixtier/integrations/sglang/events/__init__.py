"""Tier-3 KV events in SGLang's format: the event builder (kv_events.py), the `radixtier` KV-event
publisher that joins them to SGLang's own stream (stream.py), where the backend and that publisher
meet (sinks.py, link.py) and the token ids learned from SGLang's events (page_tokens.py). Loaded only
when events are configured."""
