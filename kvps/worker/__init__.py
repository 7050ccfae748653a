"""The worker role: a KVStore's distributed backend, its I/O thread and its requests to the servers."""
