"""Processes and their collectives: `collectives.py` (rank, world size, barrier, agree, object
broadcast), `spawn.py` (the multi-process runner), `devices.py` (which device a rank computes on),
`device_guard.py` (`train.device_guard`), `ports.py` (free ports)."""
