"""The server role: holds shards of the keys, merges each round's pushes and runs the optimizer on them."""
