"""Stand-ins for the sockets of a server's loop, for tests that feed it messages."""


class Router:
    """A server's socket holding a burst of received ``(identity, frames)`` messages."""

    def __init__(self, messages):
        self.messages = list(messages)
        self.raw = self

    def recv_from(self):
        return self.messages.pop(0)

    def poll(self, timeout):
        return bool(self.messages)
