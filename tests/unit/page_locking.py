"""A host stand-in for cudaHostRegister (kvps.pinning's Locker), for tests without a GPU."""


class HostLocker:
    """kvps.pinning's Locker on the host, standing in for cudaHostRegister: records every lock
    and unlock (into ``log``, which other stand-ins may share to show the order of events),
    refuses what ``refuse(address, nbytes, writable)`` says, and checks that nothing is
    locked twice or unlocked unlocked."""

    def __init__(self, log=None, refuse=None):
        self.log = [] if log is None else log
        self.locked = {}                   # address -> (nbytes, writable)
        self.refuse = refuse

    def lock(self, address, nbytes, writable):
        from kvps.pinning import LockFailed
        if self.refuse is not None and self.refuse(address, nbytes, writable):
            raise LockFailed('operation not permitted (RLIMIT_MEMLOCK, in the stand-in)')
        assert address not in self.locked, 'locked twice'
        self.locked[address] = (nbytes, writable)
        self.log.append(('lock', address, nbytes, writable))

    def unlock(self, address):
        assert address in self.locked, 'unlocked what was not locked'
        del self.locked[address]
        self.log.append(('unlock', address))

    def locks(self):
        return [entry for entry in self.log if entry[0] == 'lock']
