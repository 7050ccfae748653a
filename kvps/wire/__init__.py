"""How nodes talk: the wire format, sockets, message authentication, shared memory, and each node's link to the scheduler."""
