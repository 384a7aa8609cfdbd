"""Files written safely and read with positions (torch-free: the front end imports this group).

    atomic.py     atomic_write_text/bytes/json, read_stamped_json (a JSON file of one format),
                  sha256_file, the file lock helper, the cache root and its locked JSON caches
                  (cache_get / cache_put)
    yamlio.py     safe YAML loading (bad-input checks, ruamel positions)
    yamledit.py   round-trip edit of one root-level `key: value` line (text in, text out)
    tail.py       LineTail: follow a growing file by byte offset (train.log, metrics.jsonl); a
                  module's last JSON line (`last_json`)

Imports nothing of longspec but `longspec.errors`. (A docstring only: nothing loads through the package.)
"""
