"""`moe-rl train`, whatever the recipe: `driver.py` (CLI, spawning, signals; resume -> step ->
eval -> sinks -> checkpoint), `checkpoint.py` (atomic, checksummed saves and resume),
`integrity.py` (file sizes and checksums), `preflight.py` (checks before any rank starts)."""
